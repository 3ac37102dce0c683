//! EKS: what the control plane says of the cluster named on the command line. It is the source
//! of truth for which API server is that cluster (its endpoint and certificate authority), whether
//! it still exists, and whether EKS Auto Mode runs compute in it (design §7, Identity).

use base64::Engine as _;

use super::AwsError;

/// What `eks:DescribeCluster` answered for a name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EksLookup {
    /// EKS has no cluster of that name in this account and region.
    NotFound,
    /// The cluster.
    Found(EksCluster),
}

/// The parts of an EKS cluster the tool judges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EksCluster {
    /// Its ARN.
    pub arn: String,
    /// `ACTIVE`, `CREATING`, `DELETING`, `FAILED`, `UPDATING`, `PENDING`.
    pub status: String,
    /// The API server's URL, when EKS has one yet.
    pub endpoint: Option<String>,
    /// The certificates of the cluster's certificate authority (DER), decoded from
    /// `certificateAuthority.data` (base64 of PEM); empty when EKS gave none.
    pub certificate_authority: Vec<Vec<u8>>,
    /// EKS Auto Mode's compute is enabled (`computeConfig.enabled`).
    pub auto_mode: bool,
    /// When it was created, in seconds since the epoch.
    pub created: Option<i64>,
}

impl EksCluster {
    /// EKS is deleting the cluster: its compute is going with it.
    pub fn is_deleting(&self) -> bool {
        self.status == "DELETING"
    }
}

/// The EKS client.
#[derive(Clone, Debug)]
pub struct Eks {
    client: aws_sdk_eks::Client,
    endpoint: String,
}

impl Eks {
    pub(crate) fn new(client: aws_sdk_eks::Client, endpoint: String) -> Eks {
        Eks { client, endpoint }
    }

    /// `eks:DescribeCluster` of `name`; EKS's `ResourceNotFoundException` is [`EksLookup::NotFound`].
    pub async fn describe_cluster(&self, name: &str) -> Result<EksLookup, AwsError> {
        let out = match self.client.describe_cluster().name(name).send().await {
            Ok(out) => out,
            Err(e) => {
                let e = AwsError::from_sdk("eks", "DescribeCluster", &self.endpoint, e);
                return if e.code() == Some("ResourceNotFoundException") { Ok(EksLookup::NotFound) } else { Err(e) };
            }
        };
        let Some(c) = out.cluster() else { return Ok(EksLookup::NotFound) };
        Ok(EksLookup::Found(EksCluster {
            arn: c.arn().unwrap_or_default().to_string(),
            status: c.status().map(|s| s.as_str().to_string()).unwrap_or_default(),
            endpoint: c.endpoint().filter(|e| !e.is_empty()).map(str::to_string),
            certificate_authority: c
                .certificate_authority()
                .and_then(|ca| ca.data())
                .map(certificates_of_base64_pem)
                .unwrap_or_default(),
            auto_mode: c.compute_config().and_then(|cc| cc.enabled()).unwrap_or(false),
            created: c.created_at().map(|t| t.secs()),
        }))
    }
}

/// The DER certificates of a base64-encoded PEM bundle, as EKS gives `certificateAuthority.data`
/// and as a kubeconfig's `certificate-authority-data` holds it; what does not decode is left out,
/// so a garbled authority matches nothing.
pub(crate) fn certificates_of_base64_pem(data: &str) -> Vec<Vec<u8>> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let Ok(pem) = b64.decode(data.trim()) else { return Vec::new() };
    let pem = String::from_utf8_lossy(&pem);
    let mut out = Vec::new();
    let mut body: Option<String> = None;
    for line in pem.lines().map(str::trim) {
        if line == "-----BEGIN CERTIFICATE-----" {
            body = Some(String::new());
        } else if line == "-----END CERTIFICATE-----" {
            if let Some(der) = body.take().and_then(|b| b64.decode(b).ok()) {
                out.push(der);
            }
        } else if let Some(b) = body.as_mut() {
            b.push_str(line);
        }
    }
    out
}

/// Whether two API server URLs name the same server: scheme, host (case-insensitive) and port,
/// the scheme's default port filled in, a trailing slash ignored.
pub(crate) fn same_server(a: &str, b: &str) -> bool {
    fn parts(url: &str) -> Option<(String, String, u16, String)> {
        let uri: http::Uri = url.trim().parse().ok()?;
        let scheme = uri.scheme_str()?.to_ascii_lowercase();
        let host = uri.host()?.to_ascii_lowercase();
        let port = uri.port_u16().or(match scheme.as_str() {
            "https" => Some(443),
            "http" => Some(80),
            _ => None,
        })?;
        Some((scheme, host, port, uri.path().trim_end_matches('/').to_string()))
    }
    matches!((parts(a), parts(b)), (Some(x), Some(y)) if x == y)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pem_b64(ders: &[&[u8]]) -> String {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut pem = String::new();
        for der in ders {
            pem.push_str("-----BEGIN CERTIFICATE-----\n");
            let body = b64.encode(der);
            for chunk in body.as_bytes().chunks(64) {
                pem.push_str(std::str::from_utf8(chunk).unwrap());
                pem.push('\n');
            }
            pem.push_str("-----END CERTIFICATE-----\n");
        }
        b64.encode(pem)
    }

    #[test]
    fn a_base64_pem_bundle_decodes_to_each_certificate() {
        let long = vec![7u8; 200];
        let certs = certificates_of_base64_pem(&pem_b64(&[b"first", &long]));
        assert_eq!(certs.len(), 2);
        assert_eq!(certs[0], b"first");
        assert_eq!(certs[1], long);
        assert!(certificates_of_base64_pem("not base64!").is_empty());
        assert!(certificates_of_base64_pem(&pem_b64(&[])).is_empty());
    }

    #[test]
    fn servers_compare_by_scheme_host_and_port() {
        let eks = "https://ABC123.gr7.us-west-2.eks.amazonaws.com";
        assert!(same_server(eks, "https://abc123.gr7.us-west-2.eks.amazonaws.com/"));
        assert!(same_server(eks, "https://abc123.gr7.us-west-2.eks.amazonaws.com:443"));
        assert!(!same_server(eks, "https://def456.gr7.us-west-2.eks.amazonaws.com"));
        assert!(!same_server(eks, "http://abc123.gr7.us-west-2.eks.amazonaws.com"));
        assert!(!same_server("https://127.0.0.1:6443", "https://127.0.0.1:6444"));
        assert!(!same_server("https://127.0.0.1:6443/a", "https://127.0.0.1:6443/b"));
        assert!(!same_server("", ""), "nothing is no server");
    }
}
