//! The simulated side of karpenter-teardown's test bed: a generator of Karpenter-managed clusters
//! ([`world`]), a simulated Karpenter controller ([`controller`]) that behaves as design §3 says,
//! simulated Argo CD and Flux reconcilers ([`gitops`]), the LocalStack connection
//! ([`localstack`]) and an EC2 proxy that enforces EC2's request limits, its callers' IAM policy
//! ([`iampolicy`]) and EC2's own timing, and injects faults ([`ec2proxy`], [`ec2limits`]).
//!
//! Everything here talks to the sandbox API server (crate `sandbox-apiserver`) only through a
//! [`kube::Client`] over HTTP, exactly like the real controller talks to EKS, and to EC2/IAM
//! through its own calls ([`cloud`]) against LocalStack. Nothing here reaches into the server's
//! store: what the simulation does is visible to the tool under test the same way as on a real
//! cluster.
#![forbid(unsafe_code)]

pub mod cloud;
pub mod controller;
pub mod ebscsi;
pub mod ec2auth;
pub mod ec2limits;
pub mod ec2proxy;
pub mod ec2time;
pub mod gitops;
pub mod gitops_crds;
pub mod iampolicy;
pub mod karpenter;
pub mod karpenter_crds;
pub mod lbc;
pub mod localstack;
pub mod naming;
pub mod objects;
pub mod ops;
pub mod podcache;
pub mod pricelist;
pub mod standin;
pub mod world;

pub use controller::{SimController, SimSettings, SimStats};
pub use world::{World, WorldSpec, generate};

use crate::cloud::CloudError;

/// Which Karpenter release the simulation imitates. The differences that matter to a teardown:
/// the CRD conversion webhook, launch-template tags, instance-profile paths and node labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KarpenterVersion {
    /// 1.0.x: CRDs carry the conversion-webhook stanza, launch templates are tagged
    /// `karpenter.k8s.aws/cluster`, instance profiles live at path `/` named `<cluster>_<hash>`,
    /// nodes carry no `karpenter.k8s.aws/ec2nodeclass` label.
    V1_0,
    /// 1.14.x (anything since 1.7): no conversion webhook, launch templates tagged
    /// `eks:eks-cluster-name`, instance profiles under `/karpenter/<region>/<cluster>/<class-uid>/`.
    #[default]
    V1_14,
}

impl KarpenterVersion {
    /// True for 1.0.x, whose CRDs route conversion through the controller's webhook service.
    pub fn has_conversion_webhook(self) -> bool {
        self == KarpenterVersion::V1_0
    }

    /// Nodes carry the `karpenter.k8s.aws/ec2nodeclass` label since 1.1.
    pub fn labels_nodeclass(self) -> bool {
        self != KarpenterVersion::V1_0
    }

    /// The version string the controller's image tag would carry.
    pub fn as_str(self) -> &'static str {
        match self {
            KarpenterVersion::V1_0 => "1.0.14",
            KarpenterVersion::V1_14 => "1.14.1",
        }
    }
}

impl std::str::FromStr for KarpenterVersion {
    type Err = SimError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim().trim_start_matches('v');
        if s == "1.0" || s.starts_with("1.0.") {
            Ok(KarpenterVersion::V1_0)
        } else if s == "1.14" || s.starts_with("1.14.") {
            Ok(KarpenterVersion::V1_14)
        } else {
            Err(SimError::BadVersion(s.to_string()))
        }
    }
}

/// Failures of the world generator and the simulated controller.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A call to the (sandbox) Kubernetes API failed.
    #[error(
        "Kubernetes API call failed while {doing}: {source}; check that the sandbox API server is running and \
         that the client was built from its kube_config()"
    )]
    Kube {
        /// What the simulation was doing.
        doing: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A call to EC2 or IAM failed.
    #[error("AWS call failed while {doing}: {source}; check that LocalStack runs (localstack/up)")]
    Aws {
        /// What the simulation was doing.
        doing: String,
        /// The call's error.
        #[source]
        source: CloudError,
    },
    /// RunInstances answered without the instances that were asked for.
    #[error("EC2 launched {got} instances for {what} instead of {wanted}; LocalStack may be overloaded, retry")]
    ShortLaunch {
        /// What was being launched.
        what: String,
        /// How many were asked for.
        wanted: usize,
        /// How many came back.
        got: usize,
    },
    /// The control plane did not get the generated workloads running in time.
    #[error(
        "only {running} of {expected} workload pods were running when the settle timeout passed \
         (karpenter controller ready: {controller_ready}); start the sandbox server with its control plane, \
         or raise WorldSpec::settle_timeout for large worlds"
    )]
    NotSettled {
        /// Workload pods expected.
        expected: usize,
        /// Workload pods running.
        running: usize,
        /// Whether the karpenter Deployment had a ready replica.
        controller_ready: bool,
    },
    /// The API server did not start serving a CRD that was created.
    #[error("the API server did not serve CRD {crd} after it was created: {reason}; see the server's log")]
    NotEstablished {
        /// The CRD's name.
        crd: String,
        /// The timeout or the watch's error.
        reason: String,
    },
    /// The world specification cannot be generated.
    #[error("invalid world specification: {0}")]
    BadSpec(String),
    /// An unknown Karpenter version was asked for.
    #[error("unknown Karpenter version {0:?}: the simulation knows 1.0 and 1.14")]
    BadVersion(String),
    /// An object read back from the API server lacks a field the server always sets.
    #[error("the API server returned {what} without {field}; the sandbox server is not behaving like kube-apiserver")]
    Malformed {
        /// The object.
        what: String,
        /// The missing field.
        field: &'static str,
    },
}

impl SimError {
    pub(crate) fn kube(doing: impl Into<String>) -> impl FnOnce(kube::Error) -> SimError {
        let doing = doing.into();
        move |source| SimError::Kube { doing, source }
    }

    pub(crate) fn aws(doing: impl Into<String>) -> impl FnOnce(CloudError) -> SimError {
        let doing = doing.into();
        move |source| SimError::Aws { doing, source }
    }
}
