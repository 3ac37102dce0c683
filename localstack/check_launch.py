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
  an SDK whose model is newer than LocalStack's.

It also checks that the pass-through is what LocalStack's dispatcher now calls, and that an error
still goes LocalStack's way. Run by `cargo test` (tests/aws) as
`<LocalStack's virtualenv>/bin/python localstack/check_launch.py`; exits 1 with the differences.
"""

import os
import re
import sys
import xml.etree.ElementTree as ElementTree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import launch  # noqa: E402  (the patches, not yet applied: importing it does not start LocalStack)
from localstack.aws.api import CommonServiceException, ServiceException  # noqa: E402
from localstack.aws.client import parse_response  # noqa: E402
from localstack.aws.forwarder import create_aws_request_context  # noqa: E402
from localstack.aws.protocol.serializer import create_serializer  # noqa: E402
from localstack.services import moto as localstack_moto  # noqa: E402

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


def describe(parameters: dict):  # type: ignore[no-untyped-def,type-arg]
    request = context("DescribeInstances", **parameters)
    return request, localstack_moto.dispatch_to_moto(request)


def what_localstack_sent(request, response) -> bytes:  # type: ignore[no-untyped-def]
    parsed = parse_response(request.operation, request.protocol, response, include_response_metadata=False)
    serializer = create_serializer(request.service)
    return serializer.serialize_to_response(parsed, request.operation, {}, "check").data


def parsed(request, xml: bytes):  # type: ignore[no-untyped-def]
    from localstack.http import Response

    return parse_response(request.operation, request.protocol, Response(xml, 200), include_response_metadata=False)


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
    before = []
    for parameters in queries(ids):
        request, response = describe(parameters)
        check(f"moto answers {sorted(parameters)}", response.status_code == 200, response.data[:300].decode())
        before.append((parameters, response.data, what_localstack_sent(request, response)))

    launch.speed_up()

    for parameters, moto_before, localstack_before in before:
        request, response = describe(parameters)
        now = response.data
        name = f"DescribeInstances {sorted(parameters)}"
        check(
            f"{name}: moto's answer is unchanged",
            without_request_id(now) == without_request_id(moto_before),
            first_difference(parsed(request, now), parsed(request, moto_before)),
        )
        check(
            f"{name}: parsed with the EC2 model, it is what LocalStack sent",
            parsed(request, now) == parsed(request, localstack_before),
            first_difference(parsed(request, now), parsed(request, localstack_before)),
        )
        mine, theirs = element_paths(now), element_paths(localstack_before)
        check(
            f"{name}: it has the elements LocalStack sent",
            sorted(mine) == sorted(theirs),
            f"only in moto's: {sorted(set(mine) - set(theirs))}; only in LocalStack's: {sorted(set(theirs) - set(mine))}",
        )

    # the dispatcher LocalStack builds for EC2 on its first request goes through the patch
    request = context("DescribeInstances", InstanceIds=ids[:2])
    answer = localstack_moto._proxy_moto(request, {})
    check(
        "a DescribeInstances is passed through as moto wrote it",
        getattr(answer, "status_code", None) == 200 and getattr(request, "passed_through_from_moto", False),
    )
    request = context("DescribeInstances", InstanceIds=["i-0123456789abcdef0"])
    try:
        localstack_moto._proxy_moto(request, {})
        check("an unknown instance id is still an error", False, "no error raised")
    except (CommonServiceException, ServiceException) as e:
        code = getattr(e, "code", "")
        check("an unknown instance id is still LocalStack's error", code == "InvalidInstanceID.NotFound", code)
    request = context("DescribeVpcs")
    check("other operations take LocalStack's way", isinstance(localstack_moto._proxy_moto(request, {}), dict))

    if failures:
        print("\n".join(["", "launch.py's patches change LocalStack's answers:", *failures]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
