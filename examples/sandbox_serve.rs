//! Runs the sandbox API server for manual kubectl sessions:
//! `cargo run --example sandbox_serve -- 8001 /tmp/kubeconfig`, then
//! `kubectl --kubeconfig /tmp/kubeconfig get nodes`. Stops on Ctrl-C.

use karpenter_teardown::sandbox::{ApiServer, ServerOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().map(|p| p.parse()).transpose()?.unwrap_or(0);
    let kubeconfig = args.next().unwrap_or_else(|| "sandbox.kubeconfig".into());
    let server = ApiServer::start(ServerOptions { port, ..Default::default() }).await?;
    server.write_kubeconfig(std::path::Path::new(&kubeconfig), "sandbox")?;
    println!("serving on {} (kubeconfig {kubeconfig})", server.url());
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
