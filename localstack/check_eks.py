"""Checks that the LocalStack `localstack/up` starts serves EKS (the test bed's hook included),
classic ELB and ELBv2.

Runs in LocalStack's own virtualenv, in one process and without a server: it registers EKS as
launch.py does (`serve_from_moto`), builds LocalStack's gateway (the handler chain its server runs: the
service found from the request's signature, SERVICES, the provider, moto behind it) and sends it
boto3's requests, signed and serialized by boto3, in-process. It checks:

- that `up` and docker-compose.yml enable EKS, and `up` waits for it;
- CreateCluster with the hook's tags: the cluster's `endpoint` and `certificateAuthority.data` are
  theirs (a CA of about 2 KB), the tags are gone, `computeConfig` and `storageConfig` come back,
  the status is ACTIVE; without the tags, moto's own; per region;
- a name in use is ResourceInUseException (409); DeleteCluster, then DescribeCluster is
  ResourceNotFoundException (404), and the name can be created again;
- ELBv2 and classic ELB: load balancers and target groups with their tags, found by name and by
  tag in batches of 20 as the tool reads them; an unknown name is LoadBalancerNotFound (400);
  deletion protection read back from the attributes, and DeleteLoadBalancer refused with
  OperationNotPermitted while it is on (as ELBv2 does), allowed once it is off; DescribeTags naming
  a deleted load balancer or target group refused with LoadBalancerNotFound or TargetGroupNotFound
  (as ELBv2 does); a new classic load balancer described with ELB's default health check;
- that EC2 still answers, and that LocalStack running launch.py as an init script (how the Docker
  image gets EKS) serves EKS too.

Run as `localstack/.state/venv/bin/python localstack/check_eks.py`; exits 1 with the failures.
"""

import base64
import os
import re
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)


def read(name: str) -> str:
    with open(os.path.join(here, name)) as f:
        return f.read()


# the services `up` enables, as it starts LocalStack: read before LocalStack reads SERVICES
UP_SERVICES = re.search(r"\bSERVICES=([\w,-]+)", read("up")).group(1)  # type: ignore[union-attr]
os.environ["SERVICES"] = UP_SERVICES

import boto3  # noqa: E402
from botocore.awsrequest import AWSResponse  # noqa: E402
from botocore.config import Config  # noqa: E402
from botocore.exceptions import ClientError  # noqa: E402

import launch  # noqa: E402  (the patches, not yet applied: importing it does not start LocalStack)
from localstack.aws.app import LocalstackAwsGateway  # noqa: E402
from localstack.aws.client import create_http_request  # noqa: E402
from localstack.http import Response  # noqa: E402
from localstack.services.plugins import SERVICE_PLUGINS, ServiceState  # noqa: E402

# the hook's tags, as the test bed sends them
ENDPOINT_TAG = "testbed.karpenter-teardown/endpoint"
CA_TAG = "testbed.karpenter-teardown/certificate-authority-data"
ROLE = "arn:aws:iam::000000000000:role/eks"
NODE_ROLE = "arn:aws:iam::000000000000:role/nodes"
failures: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if not ok:
        failures.append(f"{name}: {detail!s:.600}")


def pem_bundle_data() -> str:
    """certificateAuthority.data as EKS returns it: base64 of a PEM bundle, here two certificates."""
    pems = []
    for n in range(2):
        der = bytes((n * 7 + i * 31) % 256 for i in range(700))
        body = base64.b64encode(der).decode()
        lines = "\n".join(body[i : i + 64] for i in range(0, len(body), 64))
        pems.append(f"-----BEGIN CERTIFICATE-----\n{lines}\n-----END CERTIFICATE-----\n")
    return base64.b64encode("".join(pems).encode()).decode()


class _Raw:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **kwargs):  # type: ignore[no-untyped-def]
        yield self.data


def client(gateway: LocalstackAwsGateway, service: str, region: str):  # type: ignore[no-untyped-def]
    """A boto3 client whose requests LocalStack's gateway answers, in this process."""
    c = boto3.client(
        service,
        region_name=region,
        endpoint_url="http://127.0.0.1:4566",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=Config(retries={"max_attempts": 1}),
    )

    def send(request, **kwargs):  # type: ignore[no-untyped-def]
        response = Response()
        gateway.process(create_http_request(request), response)
        return AWSResponse(request.url, response.status_code, dict(response.headers), _Raw(response.data))

    c.meta.events.register("before-send", send)
    return c


def error(call):  # type: ignore[no-untyped-def]
    """(HTTP status, error code) of a call that must fail, or (None, its answer)."""
    try:
        return None, call()
    except ClientError as e:
        return e.response["ResponseMetadata"]["HTTPStatusCode"], e.response["Error"]["Code"]


def check_scripts() -> None:
    enabled = set(UP_SERVICES.split(","))
    awaited = re.search(r"for svc in ([\w -]+); do", read("up"))
    composed = re.search(r"SERVICES: ([\w,-]+)", read("docker-compose.yml"))
    check(
        "up enables EKS, ELB and ELBv2, waits for every service it enables, and docker-compose.yml enables the same",
        {"eks", "elb", "elbv2"} <= enabled
        and awaited is not None
        and set(awaited.group(1).split()) == enabled
        and composed is not None
        and set(composed.group(1).split(",")) == enabled,
        f"up: SERVICES={UP_SERVICES}, waits for {awaited and awaited.group(1)}; compose: {composed and composed.group(1)}",
    )


def check_clusters(gateway: LocalstackAwsGateway) -> None:
    eks = client(gateway, "eks", "us-west-2")
    ca = pem_bundle_data()
    endpoint = "https://127.0.0.1:6443"
    compute = {"enabled": True, "nodePools": ["general-purpose", "system"], "nodeRoleArn": NODE_ROLE}
    created = eks.create_cluster(
        name="bed",
        roleArn=ROLE,
        resourcesVpcConfig={},
        computeConfig=compute,
        storageConfig={"blockStorage": {"enabled": True}},
        kubernetesNetworkConfig={"elasticLoadBalancing": {"enabled": True}},
        tags={
            ENDPOINT_TAG: endpoint,
            CA_TAG: ca,
            "team": "platform",
        },
    )["cluster"]
    described = eks.describe_cluster(name="bed")["cluster"]
    for name, cluster in [("CreateCluster", created), ("DescribeCluster", described)]:
        check(
            f"{name}: the hook's endpoint and CA ({len(ca)} characters) are the cluster's",
            cluster.get("endpoint") == endpoint and cluster.get("certificateAuthority") == {"data": ca},
            f"endpoint {cluster.get('endpoint')!r}, CA {str(cluster.get('certificateAuthority'))[:80]}",
        )
        check(f"{name}: the hook's tags are not the cluster's", cluster.get("tags") == {"team": "platform"}, cluster.get("tags"))
        check(
            f"{name}: computeConfig and storageConfig come back",
            cluster.get("computeConfig") == compute
            and cluster.get("storageConfig") == {"blockStorage": {"enabled": True}},
            f"{cluster.get('computeConfig')} {cluster.get('storageConfig')}",
        )
        check(
            f"{name}: kubernetesNetworkConfig keeps elasticLoadBalancing and a service CIDR",
            cluster.get("kubernetesNetworkConfig")
            == {"serviceIpv4Cidr": "172.20.0.0/16", "elasticLoadBalancing": {"enabled": True}},
            cluster.get("kubernetesNetworkConfig"),
        )
        check(f"{name}: ACTIVE", cluster.get("status") == "ACTIVE", cluster.get("status"))
    check(
        "the cluster is in its account and region",
        described.get("arn") == "arn:aws:eks:us-west-2:000000000000:cluster/bed",
        described.get("arn"),
    )

    status, code = error(lambda: eks.create_cluster(name="bed", roleArn=ROLE, resourcesVpcConfig={}))
    check("a name in use: ResourceInUseException (409)", (status, code) == (409, "ResourceInUseException"), (status, code))
    check("a name in use: the cluster is unchanged", eks.describe_cluster(name="bed")["cluster"] == described)

    # the minimal request, in another region: moto's own endpoint and CA
    other = client(gateway, "eks", "eu-central-1")
    plain = other.create_cluster(name="bed", roleArn=ROLE, resourcesVpcConfig={})["cluster"]
    check(
        "without the hook's tags (the minimal request): moto's endpoint and CA, ACTIVE",
        re.fullmatch(r"https://[\w.]+\.eu-central-1\.eks\.amazonaws\.com/", plain.get("endpoint", "")) is not None
        and len(plain.get("certificateAuthority", {}).get("data", "")) > 0
        and plain["certificateAuthority"]["data"] != ca
        and plain.get("tags") == {}
        and "computeConfig" not in plain
        and plain.get("status") == "ACTIVE",
        plain,
    )
    check(
        "ListClusters: each region its own",
        eks.list_clusters()["clusters"] == ["bed"] == other.list_clusters()["clusters"]
        and other.describe_cluster(name="bed")["cluster"]["endpoint"] == plain["endpoint"],
    )
    only = other.create_cluster(
        name="endpoint-only", roleArn=ROLE, resourcesVpcConfig={}, tags={ENDPOINT_TAG: endpoint}
    )["cluster"]
    check(
        "the endpoint's tag alone: that endpoint, moto's CA",
        only.get("endpoint") == endpoint and only["certificateAuthority"]["data"] != ca and only.get("tags") == {},
        only,
    )

    deleted = eks.delete_cluster(name="bed")["cluster"]
    check("DeleteCluster: DELETING", deleted.get("status") == "DELETING", deleted.get("status"))
    status, code = error(lambda: eks.describe_cluster(name="bed"))
    check("deleted: ResourceNotFoundException (404)", (status, code) == (404, "ResourceNotFoundException"), (status, code))
    status, code = error(lambda: eks.delete_cluster(name="bed"))
    check("deleted twice: ResourceNotFoundException (404)", (status, code) == (404, "ResourceNotFoundException"), (status, code))
    again = eks.create_cluster(
        name="bed",
        roleArn=ROLE,
        resourcesVpcConfig={},
        tags={ENDPOINT_TAG: "http://127.0.0.1:38211", CA_TAG: ca},
    )["cluster"]
    check(
        "deleted, then created again: the new endpoint, ACTIVE",
        eks.describe_cluster(name="bed")["cluster"]["endpoint"] == "http://127.0.0.1:38211" == again["endpoint"]
        and again["status"] == "ACTIVE",
        again,
    )
    check(
        "another region's cluster of the same name is untouched",
        other.describe_cluster(name="bed")["cluster"]["endpoint"] == plain["endpoint"],
    )


def check_load_balancers(gateway: LocalstackAwsGateway) -> None:
    ec2 = client(gateway, "ec2", "us-west-2")
    subnets = [s["SubnetId"] for s in ec2.describe_subnets()["Subnets"]][:2]
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    v2 = client(gateway, "elbv2", "us-west-2")
    tags = [{"Key": "elbv2.k8s.aws/cluster", "Value": "bed"}, {"Key": "service.k8s.aws/stack", "Value": "default/web"}]
    arns = [
        v2.create_load_balancer(Name=f"k8s-default-web{n}", Subnets=subnets, Type="network", Tags=tags)["LoadBalancers"][0][
            "LoadBalancerArn"
        ]
        for n in range(25)
    ]
    listed = [lb["LoadBalancerArn"] for lb in v2.describe_load_balancers()["LoadBalancers"]]
    check("ELBv2: 25 load balancers listed", sorted(listed) == sorted(arns), listed)
    described = v2.describe_tags(ResourceArns=arns[:20])["TagDescriptions"]
    check(
        "ELBv2: tags of 20 load balancers in one DescribeTags",
        len(described) == 20 and all(d["Tags"] == tags for d in described),
        described[:2],
    )
    status, code = error(lambda: v2.describe_load_balancers(Names=["nope"]))
    check("ELBv2: an unknown name is LoadBalancerNotFound (400)", (status, code) == (400, "LoadBalancerNotFound"), (status, code))
    tg = v2.create_target_group(Name="k8s-default-web", Protocol="TCP", Port=80, VpcId=vpc, Tags=tags)["TargetGroups"][0]
    found = v2.describe_tags(ResourceArns=[tg["TargetGroupArn"]])["TagDescriptions"]
    check("ELBv2: a target group's tags", [d["Tags"] for d in found] == [tags], found)
    protect = [{"Key": "deletion_protection.enabled", "Value": "true"}]
    v2.modify_load_balancer_attributes(LoadBalancerArn=arns[0], Attributes=protect)
    attributes = v2.describe_load_balancer_attributes(LoadBalancerArn=arns[0])["Attributes"]
    check("ELBv2: deletion protection read back", {"Key": "deletion_protection.enabled", "Value": "true"} in attributes, attributes)
    status, code = error(lambda: v2.delete_load_balancer(LoadBalancerArn=arns[0]))
    check("ELBv2: a protected load balancer is not deleted (OperationNotPermitted)", (status, code) == (400, "OperationNotPermitted"), (status, code))
    still = v2.describe_load_balancers(LoadBalancerArns=[arns[0]])["LoadBalancers"]
    check("ELBv2: and it is still there", len(still) == 1, still)
    protect[0]["Value"] = "false"
    v2.modify_load_balancer_attributes(LoadBalancerArn=arns[0], Attributes=protect)
    v2.delete_load_balancer(LoadBalancerArn=arns[0])
    status, code = error(lambda: v2.describe_load_balancers(LoadBalancerArns=[arns[0]]))
    check("ELBv2: unprotected, it is deleted", (status, code) == (400, "LoadBalancerNotFound"), (status, code))
    status, code = error(lambda: v2.describe_tags(ResourceArns=arns[:2]))
    check("ELBv2: DescribeTags naming a deleted one is LoadBalancerNotFound (400)", (status, code) == (400, "LoadBalancerNotFound"), (status, code))
    v2.delete_target_group(TargetGroupArn=tg["TargetGroupArn"])
    status, code = error(lambda: v2.describe_tags(ResourceArns=[tg["TargetGroupArn"]]))
    check("ELBv2: and one naming a deleted target group TargetGroupNotFound (400)", (status, code) == (400, "TargetGroupNotFound"), (status, code))

    elb = client(gateway, "elb", "us-west-2")
    legacy = [{"Key": "kubernetes.io/cluster/bed", "Value": "owned"}, {"Key": "kubernetes.io/service-name", "Value": "default/web"}]
    listener = [{"Protocol": "TCP", "LoadBalancerPort": 80, "InstancePort": 30080}]
    elb.create_load_balancer(LoadBalancerName="a0123456789", Listeners=listener, Subnets=subnets[:1], Tags=legacy)
    names = [d["LoadBalancerName"] for d in elb.describe_load_balancers()["LoadBalancerDescriptions"]]
    check("ELB: the classic load balancer listed", names == ["a0123456789"], names)
    found = elb.describe_tags(LoadBalancerNames=names)["TagDescriptions"]
    check("ELB: its tags", [d["Tags"] for d in found] == [legacy], found)
    status, code = error(lambda: elb.describe_tags(LoadBalancerNames=["nope"]))
    check("ELB: an unknown name is LoadBalancerNotFound (400)", (status, code) == (400, "LoadBalancerNotFound"), (status, code))
    health = elb.describe_load_balancers(LoadBalancerNames=names)["LoadBalancerDescriptions"][0].get("HealthCheck")
    default = {"Target": "TCP:30080", "Interval": 30, "Timeout": 5, "UnhealthyThreshold": 2, "HealthyThreshold": 10}
    check("ELB: a new load balancer has ELB's default health check", health == default, health)


def check_init_script() -> None:
    """The Docker image runs launch.py as LocalStack runs its init scripts, once it has listed its services."""
    program = (
        "import os, sys\n"
        "from localstack.runtime.init import PythonScriptRunner\n"
        "from localstack.services.plugins import SERVICE_PLUGINS\n"
        "before = SERVICE_PLUGINS.exists('eks')\n"
        "SERVICE_PLUGINS.list_available()\n"
        f"PythonScriptRunner().run({os.path.join(here, 'launch.py')!r})\n"
        "print(before, *(SERVICE_PLUGINS.get_state(s).value for s in ('eks', 'elb', 'elbv2')), SERVICE_PLUGINS.get_service('eks') is not None)\n"
    )
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=os.environ.copy())
    check(
        "launch.py as LocalStack's init script (the Docker image): EKS, ELB and ELBv2 available",
        run.returncode == 0 and run.stdout.split() == ["False", "available", "available", "available", "True"],
        run.stdout + run.stderr[-600:],
    )


def main() -> int:
    check_scripts()
    for service in launch.MOTO_BACKENDS:
        check(f"without launch.py, LocalStack has no {service}", not SERVICE_PLUGINS.exists(service))
    launch.serve_from_moto()
    launch.fix_answers()
    for service in launch.MOTO_BACKENDS:
        state = SERVICE_PLUGINS.get_state(service)
        check(f"with it, {service} is available (as the health endpoint reports)", state == ServiceState.AVAILABLE, state)
    gateway = LocalstackAwsGateway(SERVICE_PLUGINS)
    check_clusters(gateway)
    check_load_balancers(gateway)
    check("after requests, EKS is running", SERVICE_PLUGINS.get_state("eks") == ServiceState.RUNNING, SERVICE_PLUGINS.get_state("eks"))
    reservations = client(gateway, "ec2", "us-west-2").describe_instances()
    check("EC2 still answers", reservations["ResponseMetadata"]["HTTPStatusCode"] == 200, reservations)
    check_init_script()

    if failures:
        print("\n".join(["", "LocalStack does not serve EKS, ELB and ELBv2 as the test bed needs:", *failures]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
