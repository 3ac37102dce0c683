"""Checks that launch.py's patches change how fast LocalStack answers, not what it answers.

Runs in LocalStack's own virtualenv, in one process and without a server: it builds a small EC2
world in moto, records moto's answers to the DescribeInstance queries the tool and Karpenter make,
and what LocalStack sent for them (its own parse and serialization of moto's answer), then applies
launch.py's patches and asks again. The answers must be:

- moto's, byte for byte: caching the serializer's lookups, and the lookups of tags and instances
  by id, change no answer (the patch that does change answers, repeated filters ANDed as EC2 does,
  is applied before either is recorded);
- to a client, what LocalStack sent before: the same document once parsed with the EC2 model (the
  model the SDKs are generated from), and the same elements, so no field appears or disappears for
  an SDK whose model is newer than LocalStack's; with LocalStack's request id and content type.

Both are asked through LocalStack's EC2 service as it builds it on its first request (its provider,
moto behind it, the skeleton that serializes), so what is compared is what a client receives,
request id and content type included. It also checks that a client asking for JSON, an error and
every other operation still go LocalStack's way. Run by `cargo test` (tests/aws) as
`<LocalStack's virtualenv>/bin/python localstack/check_launch.py`; exits 1 with the differences.
"""

import os
import re
import sys
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import launch  # noqa: E402  (the patches, not yet applied: importing it does not start LocalStack)
from localstack.aws.client import parse_response  # noqa: E402
from localstack.aws.forwarder import create_aws_request_context  # noqa: E402
from localstack.aws.handlers.service import ServiceResponseParser  # noqa: E402
from localstack.aws.skeleton import Skeleton  # noqa: E402
from localstack.aws.spec import load_service  # noqa: E402
from localstack.http import Response  # noqa: E402
from localstack.services import moto as localstack_moto  # noqa: E402
from localstack.services.ec2.provider import Ec2Provider  # noqa: E402
from localstack.services.moto import MotoFallbackDispatcher  # noqa: E402

REGION = "us-west-2"
CLUSTER = "check"
failures: list[str] = []


def context(action: str, service: str = "ec2", **parameters):  # type: ignore[no-untyped-def]
    region = "us-east-1" if service == "iam" else REGION
    return create_aws_request_context(service, action, parameters=parameters, region=region)


def call(action: str, service: str = "ec2", **parameters):  # type: ignore[no-untyped-def]
    return localstack_moto.call_moto(context(action, service, **parameters))


def karpenter_tags(pool: str, claim: str) -> list[dict[str, str]]:
    return [
        {"Key": "karpenter.sh/nodepool", "Value": pool},
        {"Key": "karpenter.k8s.aws/ec2nodeclass", "Value": "default"},
        {"Key": f"kubernetes.io/cluster/{CLUSTER}", "Value": "owned"},
        {"Key": "eks:eks-cluster-name", "Value": CLUSTER},
        {"Key": "karpenter.sh/nodeclaim", "Value": claim},
        {"Key": "Name", "Value": f"{pool}/{claim}"},
    ]


def build_world() -> list[str]:
    """Instances in the shapes the tool meets: grouped and single, running, stopped, terminated."""
    call("CreateInstanceProfile", "iam", InstanceProfileName=f"{CLUSTER}_karpenter")
    vpc = call("CreateVpc", CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    subnet = call("CreateSubnet", VpcId=vpc, CidrBlock="10.9.1.0/24", AvailabilityZone=f"{REGION}b")
    group = call("CreateSecurityGroup", GroupName="nodes", Description="nodes", VpcId=vpc)["GroupId"]
    ids: list[str] = []
    grouped = call(
        "RunInstances",
        ImageId="ami-12c6146b",
        InstanceType="m5.large",
        MinCount=3,
        MaxCount=3,
        Placement={"AvailabilityZone": f"{REGION}a"},
        IamInstanceProfile={"Name": f"{CLUSTER}_karpenter"},
        MetadataOptions={"HttpTokens": "required", "HttpPutResponseHopLimit": 1},
        BlockDeviceMappings=[{"DeviceName": "/dev/xvda", "Ebs": {"VolumeSize": 20, "VolumeType": "gp3"}}],
        TagSpecifications=[{"ResourceType": "instance", "Tags": karpenter_tags("general", "general-abc")}],
    )
    ids += [i["InstanceId"] for i in grouped["Instances"]]
    for n, pool in enumerate(["general", "gpu", "general"]):
        single = call(
            "RunInstances",
            ImageId="ami-12c6146b",
            InstanceType="c5.xlarge" if pool == "gpu" else "m5.large",
            MinCount=1,
            MaxCount=1,
            SubnetId=subnet["Subnet"]["SubnetId"],
            SecurityGroupIds=[group],
            TagSpecifications=[{"ResourceType": "instance", "Tags": karpenter_tags(pool, f"{pool}-{n}")}],
        )
        ids.append(single["Instances"][0]["InstanceId"])
    # a managed node group's instance of the same cluster, and another cluster's
    for cluster in [CLUSTER, "other"]:
        other = call(
            "RunInstances",
            ImageId="ami-12c6146b",
            InstanceType="t3.medium",
            MinCount=1,
            MaxCount=1,
            TagSpecifications=[
                {
                    "ResourceType": "instance",
                    "Tags": [
                        {"Key": f"kubernetes.io/cluster/{cluster}", "Value": "owned"},
                        {"Key": "eks:nodegroup-name", "Value": "system"},
                    ],
                }
            ],
        )
        ids.append(other["Instances"][0]["InstanceId"])
    # and one nobody tagged
    bare = call("RunInstances", ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1)
    ids.append(bare["Instances"][0]["InstanceId"])
    call("CreateTags", Resources=[ids[1]], Tags=[{"Key": "added-later", "Value": "yes"}])
    call("StopInstances", InstanceIds=[ids[2]])
    call("TerminateInstances", InstanceIds=[ids[3]])
    return ids


def queries(ids: list[str]) -> list[dict]:  # type: ignore[type-arg]
    """The tool's identity evidence and pre-termination read, Karpenter's listing, a plain listing."""
    return [
        {"Filters": [{"Name": "instance-id", "Values": ids}], "MaxResults": 1000},
        {"InstanceIds": ids[:4]},
        {
            "Filters": [
                {"Name": "tag-key", "Values": ["karpenter.sh/nodepool"]},
                {"Name": "tag-key", "Values": ["karpenter.k8s.aws/ec2nodeclass"]},
                {"Name": "tag-key", "Values": [f"kubernetes.io/cluster/{CLUSTER}"]},
                {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]},
            ]
        },
        {"Filters": [{"Name": f"tag:kubernetes.io/cluster/{CLUSTER}", "Values": ["owned"]}]},
        {"MaxResults": 5},
        {},
    ]


def without_request_id(xml: bytes) -> bytes:
    return re.sub(rb"<requestId>[^<]*</requestId>", b"", xml)


def element_paths(xml: bytes) -> list[str]:
    """Every element's path, names without their namespace, in document order."""
    paths: list[str] = []

    def walk(element: ElementTree.Element, prefix: str) -> None:
        path = f"{prefix}/{element.tag.rsplit('}', 1)[-1]}"
        paths.append(path)
        for child in element:
            walk(child, path)

    walk(ElementTree.fromstring(xml), "")
    return [p for p in paths if not p.endswith("/requestId")]


def localstack_ec2() -> Skeleton:
    """EC2 as LocalStack serves it, built as on its first request: the provider, moto behind it."""
    return Skeleton(load_service("ec2"), MotoFallbackDispatcher(Ec2Provider()))


def describe(ec2: Skeleton, parameters: dict, accept: str | None):  # type: ignore[no-untyped-def,type-arg]
    """What a client gets, and what moto wrote, for one DescribeInstances."""
    request = context("DescribeInstances", **parameters)
    if accept:
        request.request.headers["Accept"] = accept
    moto = localstack_moto.dispatch_to_moto(context("DescribeInstances", **parameters))
    return request, ec2.invoke(request), moto.data


def parsed(request, response):  # type: ignore[no-untyped-def]
    return parse_response(request.operation, request.protocol, response, include_response_metadata=False)


def first_difference(a, b, path: str = "") -> str:  # type: ignore[no-untyped-def]
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{path}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for n, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{n}]")
    return f"at {path or 'the top'}: {a!r:.200} against {b!r:.200}"


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}")
    if not ok:
        failures.append(f"{name}: {detail}")


def main() -> int:
    launch.fix_answers()  # what changes answers (repeated filters ANDed) is in both
    ids = build_world()
    asked = [(q, None) for q in queries(ids)] + [({"InstanceIds": ids[:2]}, "application/json")]
    ec2 = localstack_ec2()
    before = [(q, accept, *describe(ec2, q, accept)) for q, accept in asked]

    launch.speed_up()

    ec2 = localstack_ec2()
    for (parameters, accept, request_before, answer_before, moto_before) in before:
        request, answer, moto = describe(ec2, parameters, accept)
        name = f"DescribeInstances {sorted(parameters)}" + (f" (Accept: {accept})" if accept else "")
        check(f"{name}: answered", answer.status_code == 200 == answer_before.status_code, answer.data[:300].decode())
        check(
            f"{name}: moto's answer is unchanged",
            without_request_id(moto) == without_request_id(moto_before),
            first_difference(parsed(request, Response(moto, 200)), parsed(request, Response(moto_before, 200))),
        )
        passed = getattr(request, "passed_through_from_moto", False)
        check(f"{name}: {'not ' if accept else ''}passed through", passed != bool(accept))
        check(
            f"{name}: its request id and content type are LocalStack's",
            answer.headers.get("x-amzn-RequestId") == request.request_id
            and answer.headers.get("Content-Type") == answer_before.headers.get("Content-Type")
            and (accept or f"<requestId>{request.request_id}</requestId>".encode() in answer.data),
            f"{dict(answer.headers)} against {dict(answer_before.headers)}",
        )
        if accept:
            continue
        check(
            f"{name}: parsed with the EC2 model, it is what LocalStack sent",
            parsed(request, answer) == parsed(request_before, answer_before),
            first_difference(parsed(request, answer), parsed(request_before, answer_before)),
        )
        mine, theirs = element_paths(answer.data), element_paths(answer_before.data)
        check(
            f"{name}: it has the elements LocalStack sent",
            sorted(mine) == sorted(theirs),
            f"only in moto's: {sorted(set(mine) - set(theirs))}; only in LocalStack's: {sorted(set(theirs) - set(mine))}",
        )
        # LocalStack's last response handler parses what it did not serialize; not this
        ServiceResponseParser()(None, request, answer)
        check(f"{name}: LocalStack does not parse it again", request.service_response is None)

    request = context("DescribeInstances", InstanceIds=["i-0123456789abcdef0"])
    answer = ec2.invoke(request)
    check(
        "an unknown instance id is still LocalStack's error",
        answer.status_code == 400 and b"<Code>InvalidInstanceID.NotFound</Code>" in answer.data,
        answer.data[:300].decode(),
    )
    request = context("DescribeVpcs")
    ec2.invoke(request)
    check(
        "other operations take LocalStack's way",
        not getattr(request, "passed_through_from_moto", False) and request.service_response is not None,
    )

    if failures:
        print("\n".join(["", "launch.py's patches change LocalStack's answers:", *failures]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
