//! Karpenter 1.0 calls AWS through aws-sdk-go v1 (karpenter-provider-aws v1.0.14's go.mod pins
//! github.com/aws/aws-sdk-go v1.55.5), which has no `AWS_ENDPOINT_URL`: that variable is read only
//! by aws-sdk-go-v2 and the other SDKs of the "service-specific endpoints" feature
//! (https://docs.aws.amazon.com/sdkref/latest/guide/feature-ss-endpoints.html lists Go v2 only;
//! aws-sdk-go v1.55.5's `aws/session` has no mention of it). Its operator builds the session with
//! no endpoint either (`pkg/operator/operator.go`, `NewOperator`), so 1.0 always dials
//! `https://<service>.<region>.amazonaws.com`.
//!
//! The narrowest way to reach LocalStack without changing a byte of Karpenter is the SDK's HTTP
//! client: it is Go's default transport, which honours `HTTPS_PROXY` (CONNECT), and the SDK
//! trusts the certificates of `AWS_CA_BUNDLE`. This relay answers CONNECT for AWS hosts only, ends TLS with
//! a certificate made for this run (self-signed, named for the AWS hosts Karpenter calls) and
//! passes the plain HTTP/1.1 stream to the endpoint the tests name (LocalStack, or a proxy before
//! it). LocalStack picks the service from the request's SigV4 credential scope, not the host, so
//! the requests need no rewriting.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use super::{KarpenterError, io};

/// The longest CONNECT request head the relay reads; Go's sends well under 1 KiB.
const MAX_HEAD: usize = 8192;

/// The host names the relay's certificate is valid for: every regional endpoint of the region
/// (EC2, SSM, STS, pricing) and the global ones (IAM). A wildcard covers one label only (RFC 6125
/// §6.4.3), so both levels are named.
pub(crate) fn certificate_names(region: &str) -> Vec<String> {
    vec![format!("*.{region}.amazonaws.com"), "*.amazonaws.com".to_string()]
}

/// The `host:port` a CONNECT request head asks for, when it is an AWS endpoint on 443: the relay
/// terminates TLS for those names only, and everything else is refused rather than sent to
/// LocalStack under a name that is not AWS's.
pub(crate) fn connect_target(head: &str) -> Option<&str> {
    let line = head.lines().next()?;
    let mut parts = line.split_whitespace();
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    if method != "CONNECT" || !version.starts_with("HTTP/1.") || parts.next().is_some() {
        return None;
    }
    let (host, port) = target.rsplit_once(':')?;
    (port == "443" && host.ends_with(".amazonaws.com") && !host.contains(['/', '@'])).then_some(target)
}

/// The `host:port` of an `http://` endpoint URL, which the relay dials for every tunnel.
pub(crate) fn upstream_address(endpoint: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("http://")?;
    let authority = rest.split('/').next().filter(|a| !a.is_empty())?;
    Some(if authority.contains(':') { authority.to_string() } else { format!("{authority}:80") })
}

/// The certificate Karpenter is told to trust (`AWS_CA_BUNDLE`) and the relay's TLS setup.
pub(crate) struct Relay {
    /// `http://127.0.0.1:<port>`, for `HTTPS_PROXY`.
    pub(crate) proxy_url: String,
    /// The PEM certificate, for `AWS_CA_BUNDLE`.
    pub(crate) ca_file: PathBuf,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn openssl(dir: &Path, args: &[&str]) -> Result<(), KarpenterError> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(io("running openssl for the AWS relay's certificate (install openssl)"))?;
    if out.status.success() {
        return Ok(());
    }
    Err(KarpenterError::Io {
        what: format!("openssl {}", args.first().copied().unwrap_or_default()),
        source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
    })
}

/// Makes the certificate in `dir` and starts relaying to `endpoint` (an `http://` URL).
pub(crate) async fn start(dir: &Path, region: &str, endpoint: &str) -> Result<Relay, KarpenterError> {
    let upstream = upstream_address(endpoint).ok_or_else(|| KarpenterError::Io {
        what: format!("the AWS endpoint {endpoint}"),
        source: std::io::Error::other("Karpenter 1.0 is relayed to a plain http://host:port endpoint only"),
    })?;
    let san = certificate_names(region).iter().map(|n| format!("DNS:{n}")).collect::<Vec<_>>().join(",");
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=amazonaws.com",
            "-addext",
            &format!("subjectAltName={san}"),
            "-keyout",
            "relay.key",
            "-out",
            "relay.crt",
        ],
    )?;
    openssl(dir, &["x509", "-in", "relay.crt", "-outform", "DER", "-out", "relay.crt.der"])?;
    openssl(dir, &["pkcs8", "-topk8", "-nocrypt", "-in", "relay.key", "-outform", "DER", "-out", "relay.key.der"])?;
    let read = |name: &str| std::fs::read(dir.join(name)).map_err(io(format!("reading {name}")));
    let cert = CertificateDer::from(read("relay.crt.der")?);
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(read("relay.key.der")?));
    // the provider named, not the process default: the workspace links aws-lc-rs and ring both
    let tls_err = |e: rustls::Error| KarpenterError::Io {
        what: "the AWS relay's TLS configuration".into(),
        source: std::io::Error::other(e),
    };
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .map_err(tls_err)?;
    // no ALPN: Go's client then speaks HTTP/1.1, which passes through to LocalStack unchanged
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(io("binding the AWS relay"))?;
    let port = listener.local_addr().map_err(io("binding the AWS relay"))?.port();
    let task = tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let (acceptor, upstream) = (acceptor.clone(), upstream.clone());
            tokio::spawn(async move {
                if let Err(e) = tunnel(conn, acceptor, &upstream).await {
                    tracing::debug!(error = %e, "the AWS relay dropped a tunnel");
                }
            });
        }
    });
    Ok(Relay { proxy_url: format!("http://127.0.0.1:{port}"), ca_file: dir.join("relay.crt"), task })
}

async fn tunnel(mut conn: TcpStream, acceptor: TlsAcceptor, upstream: &str) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    // byte by byte up to the blank line: the TLS handshake that follows must stay unread
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD || conn.read(&mut byte).await? == 0 {
            return Ok(());
        }
        head.push(byte[0]);
    }
    if connect_target(&String::from_utf8_lossy(&head)).is_none() {
        conn.write_all(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n").await?;
        return Ok(());
    }
    conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n").await?;
    let mut tls = acceptor.accept(conn).await?;
    let mut plain = TcpStream::connect(upstream).await?;
    tokio::io::copy_bidirectional(&mut tls, &mut plain).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_aws_endpoints_on_443_are_relayed() {
        let head = |line: &str| format!("{line}\r\nHost: x\r\n\r\n");
        assert_eq!(
            connect_target(&head("CONNECT ec2.us-west-2.amazonaws.com:443 HTTP/1.1")),
            Some("ec2.us-west-2.amazonaws.com:443")
        );
        assert_eq!(connect_target(&head("CONNECT iam.amazonaws.com:443 HTTP/1.1")), Some("iam.amazonaws.com:443"));
        assert_eq!(connect_target(&head("CONNECT example.com:443 HTTP/1.1")), None);
        assert_eq!(connect_target(&head("CONNECT ec2.us-west-2.amazonaws.com:80 HTTP/1.1")), None);
        assert_eq!(connect_target(&head("CONNECT amazonaws.com.evil.test:443 HTTP/1.1")), None);
        assert_eq!(connect_target(&head("GET http://ec2.us-west-2.amazonaws.com/ HTTP/1.1")), None);
        assert_eq!(connect_target(""), None);
    }

    #[test]
    fn the_upstream_is_the_endpoints_host_and_port() {
        assert_eq!(upstream_address("http://127.0.0.1:4566").as_deref(), Some("127.0.0.1:4566"));
        assert_eq!(upstream_address("http://127.0.0.1:4566/").as_deref(), Some("127.0.0.1:4566"));
        assert_eq!(upstream_address("http://localstack").as_deref(), Some("localstack:80"));
        assert_eq!(upstream_address("https://127.0.0.1:4566"), None);
        assert_eq!(upstream_address("http://"), None);
    }

    #[test]
    fn the_certificate_names_regional_and_global_endpoints() {
        let names = certificate_names("us-west-2");
        let covers = |host: &str| {
            names.iter().any(|n| match n.strip_prefix("*.") {
                Some(parent) => host.split_once('.').is_some_and(|(_, rest)| rest == parent),
                None => n == host,
            })
        };
        assert!(covers("ec2.us-west-2.amazonaws.com"));
        assert!(covers("ssm.us-west-2.amazonaws.com"));
        assert!(covers("iam.amazonaws.com"));
        assert!(!covers("ec2.eu-west-1.amazonaws.com"));
    }
}
