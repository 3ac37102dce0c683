//! A stand-in for the delete path of the EBS CSI driver's controller (csi-provisioner, built on
//! kubernetes-sigs/sig-storage-lib-external-provisioner, over the driver's `DeleteVolume`),
//! which the Go module proxy does not serve: what `--release volumes` relies on, done as the
//! real one does it, against LocalStack's EC2.
//!
//! - A PersistentVolume is the provisioner's to delete when (`shouldDelete` in the library's
//!   `controller/controller.go`) it is not being deleted, its phase is `Released`, its reclaim
//!   policy `Delete`, and its `pv.kubernetes.io/provisioned-by` annotation names the driver
//!   (`ebs.csi.aws.com`). The PV controller of kube-controller-manager sets `Released` once the
//!   claim is gone, and leaves such a PV to the external deleter.
//! - `deleteVolumeOperation` then deletes the volume in the cloud (the driver's `DeleteVolume`:
//!   `ec2:DeleteVolume`, a volume already gone is success, one still attached an error retried
//!   later), then deletes the PV object, then removes its finalizer
//!   `external-provisioner.volume.kubernetes.io/finalizer`.
//! - It acts only while one of its pods (`app.kubernetes.io/name=aws-ebs-csi-driver`) runs on a
//!   node that is there (`crate::standin`): evicted with its node's drain, it does nothing more,
//!   as on EKS.
//!
//! Provisioning is not played (a test makes the volume and its PV as the provisioner would), nor
//! is the attacher (the test bed's control plane runs no attach-detach controller).

use std::time::Duration;

use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};

use crate::standin::StandIn;

/// The driver's name: the PV's `spec.csi.driver` and its provisioned-by annotation.
pub const DRIVER: &str = "ebs.csi.aws.com";
/// csi-provisioner's finalizer on a PV it will delete.
pub const FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";
/// The annotation naming the provisioner that made a PV (the library's `annDynamicallyProvisioned`).
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";
/// The label of its controller's pods (its chart's).
pub const CHART_LABEL: &str = "app.kubernetes.io/name=aws-ebs-csi-driver";

/// Starts the stand-in, reconciling every `interval`, with `config` for LocalStack's EC2.
pub fn start(client: Client, config: &aws_config::SdkConfig, interval: Duration) -> StandIn {
    let ec2 = aws_sdk_ec2::Client::new(config);
    let api = client.clone();
    StandIn::spawn(client, CHART_LABEL, "EBS CSI controller", interval, move || {
        let (client, ec2) = (api.clone(), ec2.clone());
        async move { reconcile(&client, &ec2).await }
    })
}

/// The PV is Released, of reclaim policy `Delete` and made by this driver: `shouldDelete`,
/// but for the deletion timestamp, which `deleteVolumeOperation` sets itself before it removes
/// its finalizer (a pass that failed in between finishes it in the next).
pub fn released_to_us(pv: &PersistentVolume) -> bool {
    let spec = pv.spec.as_ref();
    pv.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Released")
        && spec.and_then(|s| s.persistent_volume_reclaim_policy.as_deref()) == Some("Delete")
        && pv.annotations().get(PROVISIONED_BY).map(String::as_str) == Some(DRIVER)
}

async fn reconcile(client: &Client, ec2: &aws_sdk_ec2::Client) -> Result<(), String> {
    let api: Api<PersistentVolume> = Api::all(client.clone());
    let list = api.list(&ListParams::default()).await.map_err(|e| e.to_string())?;
    for pv in list.items.into_iter().filter(released_to_us) {
        let name = pv.name_any();
        let Some(id) = pv.spec.as_ref().and_then(|s| s.csi.as_ref()).map(|c| c.volume_handle.clone()) else {
            continue;
        };
        // the driver's DeleteVolume: a volume already gone is success; one still attached
        // fails (VolumeInUse) and is tried again in the next pass
        match ec2.delete_volume().volume_id(&id).send().await {
            Ok(_) => {}
            Err(e) if e.as_service_error().and_then(|s| s.meta().code()) == Some("InvalidVolume.NotFound") => {}
            Err(e) => return Err(format!("DeleteVolume {id}: {e:?}")),
        }
        if pv.metadata.deletion_timestamp.is_none() {
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        let Some(now) = api.get_opt(&name).await.map_err(|e| e.to_string())? else { continue };
        let kept: Vec<String> = now.finalizers().iter().filter(|f| *f != FINALIZER).cloned().collect();
        if kept.len() == now.finalizers().len() {
            continue;
        }
        let patch = Patch::Merge(
            serde_json::json!({"metadata": {"finalizers": kept, "resourceVersion": now.resource_version()}}),
        );
        match api.patch(&name, &PatchParams::default(), &patch).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}
