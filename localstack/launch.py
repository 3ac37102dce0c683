"""Runs LocalStack on the host with two fixes to the EC2 emulator: one to its speed, one to its answers.

moto (LocalStack's EC2 emulator) finds one resource's tags by scanning the tags of every resource
in the account (`TaggedEC2Resource.get_tags` calls `describe_tags` with a resource-id filter, which
walks all of them and compiles a pattern per tag). Describing or filtering N instances therefore
costs N x (all tags): with 5,000 tagged instances, measured here, one DescribeInstances of 200
instances took 6.2 s and a page of 1,000 took 32 s, so a 5,000-node teardown spent minutes waiting
on the emulator where EC2 answers in about a second. Reading the resource's own tag map gives the
same list in the same order (describe_tags matches the id exactly: fnmatch patterns are anchored,
and instance ids hold no wildcard characters), in constant time.

EC2 ANDs every filter of a Describe call, the same filter name given twice included: Karpenter
asks for its instances with three `tag-key` filters (its NodePool tag, its EC2NodeClass tag, the
cluster's `kubernetes.io/cluster/<name>`: karpenter-provider-aws `pkg/providers/instance`). moto
reads the filters into a dict by name, so the last `tag-key` alone counts, and Karpenter 1.0's
garbage collector then takes any instance of the cluster (a managed node group's) for one of its
own and terminates it. The filters keep being a dict for moto's lookups by name, but iterating them
(which is how moto applies them) yields every filter given, so repeated names are ANDed as EC2
does.

moto finds one instance by id (`get_instance`, which terminating, detaching a volume and most
per-instance calls go through) by copying every reservation in the account (`all_reservations`
makes a shallow copy of each, so that a describe can narrow a copy's instance list) and then
walking them. Karpenter launches each instance in a reservation of its own, so with 5,000 of them
one termination took about 55 ms here, measured: a `TerminateInstances` of 500 took 28 to 34 s
where EC2 answers in about one. The lookup only reads, so it walks the reservations themselves,
which yields the same instance objects in the same order without the copies.

Describing instances then still cost about 5 ms an instance, in three places: moto's serializer
works out anew, for every field of every instance, under which attribute names the field may be
stored (from the object's class, the key and the model's shape, none of which change between
calls) and parses every launch time from its text; LocalStack then parses moto's XML with the EC2
model and serializes it again, and parses it once more for its own request log. For EC2 the first
two are cached, and a successful DescribeInstances goes to the client as moto wrote it, which
LocalStack's answer was a copy of, with LocalStack's request id (errors, JSON and every other
operation still go LocalStack's way). Measured here with 1,000 instances, a describe of 200 took
1.05 to 1.15 s before and 0.48 to 0.53 s after. `localstack/check_launch.py` (run by the tests)
proves the answers unchanged: moto's byte for byte, and to a client parsing them with the EC2
model what LocalStack sent before.

LocalStack's community edition has no EKS, and the tool asks EKS (DescribeCluster) which cluster
a kubeconfig reaches: it compares the kubeconfig's server URL and CA with the cluster's `endpoint`
and `certificateAuthority.data`. moto has an EKS backend, so `serve_from_moto` registers a provider for
"eks" with LocalStack's service plugins (the `localstack.aws.provider` namespace its other services
come from; `SERVICES` in `localstack/up` enables it, and the health endpoint reports it) whose every
operation goes to moto, as `MotoFallbackDispatcher` sends those a provider leaves to moto. Clusters
are per account and region, ACTIVE as soon as they are created; a name in use is
ResourceInUseException (409), an unknown one ResourceNotFoundException (404). LocalStack reads the
error code of a REST-JSON answer from an `x-amzn-errortype` header in a dict that, unlike a
client's, minds the case, and moto writes `X-Amzn-ErrorType`: the provider hands it over in lower
case, or every EKS error would have its HTTP status for a code. Three things moto does not do, the
provider adds to CreateCluster:

- the test bed's hook: the tags `testbed.karpenter-teardown/endpoint` and
  `testbed.karpenter-teardown/certificate-authority-data` (base64 of a PEM bundle, as EKS returns
  it; longer than the 256 characters EKS allows a tag value, which neither LocalStack nor moto
  checks) become the cluster's `endpoint` and `certificateAuthority.data`, in place of moto's
  random ones, and are not kept as tags, so that the cluster the test bed creates is the
  Kubernetes API server it started;
- `computeConfig` (EKS Auto Mode) and `storageConfig` are kept and returned, as EKS does
  (moto drops them), and a `kubernetesNetworkConfig` without `serviceIpv4Cidr` keeps moto's
  default CIDR;
- DeleteCluster answers with the cluster `DELETING`, as EKS does (moto deletes it at once, so a
  DescribeCluster right after is already ResourceNotFoundException).

moto serves classic ELB and ELBv2 (load balancers, target groups, their tags and attributes) the
same way, with one difference from ELBv2 mended: moto deletes a load balancer whose
`deletion_protection.enabled` is `true`, where ELBv2 refuses with OperationNotPermitted; the
patch refuses as ELBv2 does, so no test passes because the emulator deleted what AWS keeps.

`localstack/check_eks.py` proves these through LocalStack's gateway. In the Docker image, which
starts LocalStack its own way, `localstack/docker-compose.yml` mounts this file as an init script
(`/etc/localstack/init/start.d`), which LocalStack runs in its process as it starts: that serves
EKS the same way; the other patches stay out of the image.

Started by `localstack/up` instead of `python -m localstack.runtime.main`.
"""

import runpy
import sys


def _patch_tag_lookup() -> None:
    try:
        from moto.ec2.models import core
        from moto.ec2.models.tags import EC2_PREFIX_TO_RESOURCE, get_prefix
    except ImportError as e:  # a different moto: run it as it is, slower
        print(f"localstack/launch.py: not patching moto's tag lookup ({e})", file=sys.stderr)
        return

    def get_tags(self):  # type: ignore[no-untyped-def]
        if not self.id:
            return []
        # .get, not [], so that asking does not add an empty entry to the defaultdict
        tags = self.ec2_backend.tags.get(self.id) or {}
        resource_type = EC2_PREFIX_TO_RESOURCE.get(get_prefix(self.id), "")
        return [
            {"resource_id": self.id, "key": k, "value": v, "resource_type": resource_type}
            for k, v in tags.items()
        ]

    core.TaggedEC2Resource.get_tags = get_tags


def _patch_repeated_filters() -> None:
    try:
        from moto.ec2.exceptions import EC2ClientError
        from moto.ec2.responses._base_response import EC2BaseResponse
    except ImportError as e:  # a different moto: run it as it is
        print(f"localstack/launch.py: not patching moto's filters ({e})", file=sys.stderr)
        return

    class Filters(dict):  # type: ignore[type-arg]
        """By name, the last values given (moto's own reading); iterated, every filter given."""

        def __init__(self, pairs):  # type: ignore[no-untyped-def]
            super().__init__(pairs)
            self._pairs = list(pairs)

        def items(self):  # type: ignore[no-untyped-def]
            return list(self._pairs)

    def filters_from_querystring(self):  # type: ignore[no-untyped-def]
        given = self._get_param("Filters", []) or self._get_param("Filter", [])
        try:
            return Filters([(f["Name"], f.get("Values", [])) for f in given])
        except KeyError:
            raise EC2ClientError("InvalidParameterValue", "The filter 'null' is invalid.")

    EC2BaseResponse._filters_from_querystring = filters_from_querystring


def _patch_instance_lookup() -> None:
    try:
        from moto.ec2.exceptions import InvalidInstanceIdError
        from moto.ec2.models.instances import InstanceBackend
    except ImportError as e:  # a different moto: run it as it is, slower
        print(f"localstack/launch.py: not patching moto's instance lookup ({e})", file=sys.stderr)
        return

    def get_instance_by_id(self, instance_id):  # type: ignore[no-untyped-def]
        # list(): another request may launch while this one walks, as moto's own copy allows
        for reservation in list(self.reservations.values()):
            for instance in reservation.instances:
                if instance.id == instance_id:
                    return instance
        return None

    def get_instance(self, instance_id):  # type: ignore[no-untyped-def]
        instance = get_instance_by_id(self, instance_id)
        if instance is None:
            raise InvalidInstanceIdError(instance_id)
        return instance

    InstanceBackend.get_instance_by_id = get_instance_by_id
    InstanceBackend.get_instance = get_instance


def _patch_serializer_lookups() -> None:
    try:
        from moto.core import serialize
    except ImportError as e:  # a different moto: run it as it is, slower
        print(f"localstack/launch.py: not patching moto's serializer ({e})", file=sys.stderr)
        return
    picker = serialize.XFormedAttributePicker
    timestamps = serialize.TimestampSerializer
    if not hasattr(picker, "get_possible_keys") or not hasattr(timestamps, "_convert_timestamp_to_str"):
        print("localstack/launch.py: not patching moto's serializer (its layout changed)", file=sys.stderr)
        return

    possible_keys = picker.get_possible_keys
    keys_seen: dict = {}  # type: ignore[type-arg]

    def get_possible_keys(self, context):  # type: ignore[no-untyped-def]
        # What the names depend on, and nothing else: the alias providers look at the object's
        # class and its Meta, the key, and the shape with the parent moto gives it (each member
        # shape object belongs to one parent's `members`, so its parent never changes). EC2's
        # only: moto builds new shapes for every error it serializes, and IAM's errors have
        # members, which would fill the cache one error at a time.
        service = getattr(context.service_model, "service_name", None)
        if service != "ec2":
            return possible_keys(self, context)
        obj = context.obj
        key = (tuple(self.alias_providers), type(obj), getattr(obj, "Meta", None), context.key, context.shape)
        try:
            return keys_seen[key]
        except KeyError:
            pass
        except TypeError:  # something unhashable: moto's own way
            return possible_keys(self, context)
        if len(keys_seen) > 100_000:  # a model that makes new shapes per call must not grow this
            keys_seen.clear()
        names = keys_seen[key] = tuple(possible_keys(self, context))
        return names

    convert = timestamps._convert_timestamp_to_str
    converted: dict = {}  # type: ignore[type-arg]

    def convert_timestamp_to_str(self, value, timestamp_format):  # type: ignore[no-untyped-def]
        # moto keeps launch times as strings; parsing one is a pure function of its text
        if not isinstance(value, str):
            return convert(self, value, timestamp_format)
        key = (value, timestamp_format)
        text = converted.get(key)
        if text is None:
            if len(converted) > 100_000:
                converted.clear()
            text = converted[key] = convert(self, value, timestamp_format)
        return text

    picker.get_possible_keys = get_possible_keys
    timestamps._convert_timestamp_to_str = convert_timestamp_to_str


# The operations whose successful answer goes to the client as moto wrote it
PASSED_THROUGH = {("ec2", "DescribeInstances")}


def _patch_describe_passthrough() -> None:
    try:
        from localstack.aws.forwarder import dispatch_to_backend
        from localstack.aws.handlers.service import ServiceResponseParser
        from localstack.services import moto as localstack_moto
    except ImportError as e:  # a different LocalStack: run it as it is, slower
        print(f"localstack/launch.py: not passing moto's answers through ({e})", file=sys.stderr)
        return
    if not hasattr(localstack_moto, "_proxy_moto") or not hasattr(localstack_moto, "dispatch_to_moto"):
        print("localstack/launch.py: not passing moto's answers through (LocalStack's layout changed)", file=sys.stderr)
        return

    proxy_moto = localstack_moto._proxy_moto

    def proxy(context, request):  # type: ignore[no-untyped-def]
        accept = context.request.headers.get("Accept", "")
        if (
            (context.service.service_name, context.operation.name) not in PASSED_THROUGH
            # moto writes XML only; LocalStack answers JSON or CBOR to a client that asks for it
            or "json" in accept
            or "cbor" in accept
        ):
            return proxy_moto(context, request)
        response = localstack_moto.dispatch_to_moto(context)
        if response.status_code == 200:
            # moto's serializer knows no request: the id is LocalStack's, in the body and the
            # header, as its own serializer writes them
            request_id = context.request_id
            response.data = response.data.replace(
                b"<requestId>request-id</requestId>", f"<requestId>{request_id}</requestId>".encode(), 1
            )
            response.headers["x-amzn-RequestId"] = request_id
            context.passed_through_from_moto = True
            return response
        # an error goes LocalStack's way (call_moto's own), so that it reads as it always did here
        return dispatch_to_backend(context, lambda _: response)

    parse_service_response = ServiceResponseParser.__call__

    def parse_unless_passed_through(self, chain, context, response):  # type: ignore[no-untyped-def]
        # the parsed answer is only for LocalStack's own request log and analytics
        if getattr(context, "passed_through_from_moto", False):
            return None
        return parse_service_response(self, chain, context, response)

    localstack_moto._proxy_moto = proxy
    ServiceResponseParser.__call__ = parse_unless_passed_through


# The test bed's hook: CreateCluster tags that become the cluster's endpoint and CA (not kept as tags)
TESTBED_ENDPOINT_TAG = "testbed.karpenter-teardown/endpoint"
TESTBED_CA_TAG = "testbed.karpenter-teardown/certificate-authority-data"
# What EKS returns of CreateCluster's request and moto drops: the request's shape is the answer's
KEPT_CLUSTER_FIELDS = {"computeConfig": "compute_config", "storageConfig": "storage_config"}


def _patch_eks_clusters() -> bool:
    try:
        from moto.eks.models import DEFAULT_KUBERNETES_NETWORK_CONFIG, EKSBackend
        from moto.eks.responses import EKSResponse
    except ImportError as e:
        print(f"localstack/launch.py: not patching moto's EKS clusters ({e})", file=sys.stderr)
        return False
    if not hasattr(EKSResponse, "create_cluster") or not hasattr(EKSBackend, "delete_cluster"):
        print("localstack/launch.py: not patching moto's EKS clusters (its layout changed)", file=sys.stderr)
        return False

    create_cluster = EKSResponse.create_cluster

    def create(self):  # type: ignore[no-untyped-def]
        result = create_cluster(self)  # a name in use raises before anything below
        cluster = self.eks_backend.clusters[self._get_param("name")]
        # moto keeps the request's tag dict as the cluster's: what is popped is not a tag
        tags = cluster.tags if isinstance(cluster.tags, dict) else {}
        endpoint, ca = tags.pop(TESTBED_ENDPOINT_TAG, None), tags.pop(TESTBED_CA_TAG, None)
        if endpoint is not None:
            cluster.endpoint = endpoint
        if ca is not None:
            cluster.certificate_authority = {"data": ca}
        for field, attribute in KEPT_CLUSTER_FIELDS.items():
            value = self._get_param(field)
            if value is not None:
                setattr(cluster, attribute, value)
        network = self._get_param("kubernetesNetworkConfig")
        if isinstance(network, dict) and "serviceIpv4Cidr" not in network:
            cluster.kubernetes_network_config = {**DEFAULT_KUBERNETES_NETWORK_CONFIG, **network}
        return result  # serialized later: the answer is the cluster as changed here

    delete_cluster = EKSBackend.delete_cluster

    def delete(self, name):  # type: ignore[no-untyped-def]
        cluster = delete_cluster(self, name)
        cluster.status = "DELETING"  # no longer stored: only the answer sees it
        return cluster

    EKSResponse.create_cluster = create
    EKSBackend.delete_cluster = delete
    return True


MOTO_BACKENDS = {
    "eks": ("moto.eks.models", "eks_backends"),
    "elb": ("moto.elb.models", "elb_backends"),
    "elbv2": ("moto.elbv2.models", "elbv2_backends"),
}


def _moto_service(name):  # type: ignore[no-untyped-def]
    """A service LocalStack's community edition lacks, built on its first request: moto behind
    every operation."""
    import importlib

    from localstack.aws.forwarder import dispatch_to_backend
    from localstack.aws.spec import load_service
    from localstack.services import moto as localstack_moto
    from localstack.services.plugins import Service

    module, backends = MOTO_BACKENDS[name]

    class MotoProvider:
        service = name

        def accept_state_visitor(self, visitor):  # type: ignore[no-untyped-def]
            visitor.visit(getattr(importlib.import_module(module), backends))

    def to_moto_backend(context):  # type: ignore[no-untyped-def]
        response = localstack_moto.dispatch_to_moto(context)
        # LocalStack parses moto's answer with headers in a plain dict, where botocore looks for
        # a REST-JSON error's code (EKS's) under this name in lower case
        error_type = response.headers.pop("X-Amzn-ErrorType", None)
        if error_type is not None:
            response.headers["x-amzn-errortype"] = error_type
        return response

    def to_moto(context, request):  # type: ignore[no-untyped-def]
        # moto raises NotImplementedError for what it lacks: LocalStack's 501, as for its others
        return dispatch_to_backend(context, to_moto_backend)

    table = {operation: to_moto for operation in load_service(name).operation_names}
    return Service.for_provider(MotoProvider(), dispatch_table_factory=lambda _: table)


def serve_from_moto() -> None:
    """Registers EKS, ELB and ELBv2 with LocalStack's service plugins (before or after it has
    listed them)."""
    try:
        from localstack.services.plugins import SERVICE_PLUGINS, aws_provider
        from localstack.utils.bootstrap import get_enabled_apis, get_preloaded_services
    except ImportError as e:
        print(f"localstack/launch.py: not serving {', '.join(MOTO_BACKENDS)} ({e})", file=sys.stderr)
        return
    # resolves LocalStack's own providers, as its first request or health check would
    providers = SERVICE_PLUGINS.api_provider_specs
    plugins = SERVICE_PLUGINS.plugin_manager
    plugins.list_plugin_specs()  # the plugin index, built
    index = getattr(plugins, "_plugin_index", None)
    create_container = getattr(plugins, "_create_container", None)
    if not isinstance(index, dict) or create_container is None:
        print("localstack/launch.py: not serving moto's services (the plugin manager's layout changed)", file=sys.stderr)
        return
    for name in MOTO_BACKENDS:
        if name in providers:
            print(f"localstack/launch.py: LocalStack has a {name} provider of its own; not adding moto's", file=sys.stderr)
            continue
        if name == "eks" and not _patch_eks_clusters():
            continue
        spec = aws_provider(api=name)(lambda name=name: _moto_service(name))
        index[spec.name] = create_container(spec)
        providers[name] = ["default"]
    # SERVICES is read against the providers that exist: again, now that these do
    get_enabled_apis.cache_clear()
    get_preloaded_services.cache_clear()


def _patch_elbv2_deletion_protection() -> None:
    try:
        from moto.elbv2.exceptions import ELBClientError
        from moto.elbv2.models import ELBv2Backend
    except ImportError as e:  # a different moto: run it as it is
        print(f"localstack/launch.py: not patching moto's ELBv2 deletion protection ({e})", file=sys.stderr)
        return
    delete_load_balancer = ELBv2Backend.delete_load_balancer

    def delete(self, arn):  # type: ignore[no-untyped-def]
        lb = self.load_balancers.get(arn)
        if lb is not None and getattr(lb, "attrs", {}).get("deletion_protection.enabled") == "true":
            raise ELBClientError(
                "OperationNotPermitted",
                f"Load balancer '{arn}' cannot be deleted because deletion protection is enabled",
            )
        return delete_load_balancer(self, arn)

    ELBv2Backend.delete_load_balancer = delete


def _patch_elbv2_describe_tags_of_the_gone() -> None:
    try:
        from moto.elbv2.exceptions import LoadBalancerNotFoundError, TargetGroupNotFoundError
        from moto.elbv2.models import ELBv2Backend
    except ImportError as e:  # a different moto: run it as it is
        print(f"localstack/launch.py: not patching moto's ELBv2 DescribeTags ({e})", file=sys.stderr)
        return
    describe_tags = ELBv2Backend.describe_tags

    # ELBv2 answers DescribeTags naming a load balancer or target group that does not exist (one
    # deleted since it was listed) with LoadBalancerNotFound or TargetGroupNotFound for the whole
    # call (the API reference's errors for DescribeTags); moto answers it with empty tags.
    def describe(self, resource_arns):  # type: ignore[no-untyped-def]
        for arn in resource_arns:
            if ":loadbalancer/" in arn and arn not in self.load_balancers:
                raise LoadBalancerNotFoundError()
            if ":targetgroup/" in arn and arn not in self.target_groups:
                raise TargetGroupNotFoundError()
        return describe_tags(self, resource_arns)

    ELBv2Backend.describe_tags = describe


def _patch_elb_default_health_check() -> None:
    try:
        from moto.elb.models import ELBBackend, FakeHealthCheck
    except ImportError as e:  # a different moto: run it as it is
        print(f"localstack/launch.py: not patching moto's classic ELB health check ({e})", file=sys.stderr)
        return
    create_load_balancer = ELBBackend.create_load_balancer

    # ELB describes every classic load balancer with a health check (`HealthCheck` and each of
    # its fields are required in the API's LoadBalancerDescription): until one is configured,
    # ELB's default of TCP on the first listener's instance port, every 30 s, 5 s timeout,
    # unhealthy after 2 and healthy after 10. moto leaves it out, and cloud-provider-aws's
    # service controller reads it right after CreateLoadBalancer (ensureLoadBalancerHealthCheck).
    def create(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        lb = create_load_balancer(self, *args, **kwargs)
        if lb.health_check is None and lb.listeners:
            target = f"TCP:{lb.listeners[0].instance_port}"
            lb.health_check = FakeHealthCheck(
                timeout="5", healthy_threshold="10", unhealthy_threshold="2", interval="30", target=target
            )
        return lb

    ELBBackend.create_load_balancer = create


def fix_answers() -> None:
    """The patches that make LocalStack answer as EC2, ELB and ELBv2 do."""
    _patch_repeated_filters()
    _patch_elbv2_deletion_protection()
    _patch_elbv2_describe_tags_of_the_gone()
    _patch_elb_default_health_check()


def speed_up() -> None:
    """The patches that make LocalStack answer sooner, and the same (localstack/check_launch.py)."""
    _patch_tag_lookup()
    _patch_instance_lookup()
    _patch_serializer_lookups()
    _patch_describe_passthrough()


if __name__ == "builtins":
    # LocalStack's init scripts (the Docker image's start.d) are run with `exec(script, {})`
    serve_from_moto()

if __name__ == "__main__":
    fix_answers()
    speed_up()
    serve_from_moto()
    sys.argv = ["localstack.runtime.main"]
    runpy.run_module("localstack.runtime.main", run_name="__main__", alter_sys=True)
