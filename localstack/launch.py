"""Runs LocalStack on the host with one fix to the EC2 emulator's speed, none to its answers.

moto (LocalStack's EC2 emulator) finds one resource's tags by scanning the tags of every resource
in the account (`TaggedEC2Resource.get_tags` calls `describe_tags` with a resource-id filter, which
walks all of them and compiles a pattern per tag). Describing or filtering N instances therefore
costs N x (all tags): with 5,000 tagged instances, measured here, one DescribeInstances of 200
instances took 6.2 s and a page of 1,000 took 32 s, so a 5,000-node teardown spent minutes waiting
on the emulator where EC2 answers in about a second. Reading the resource's own tag map gives the
same list in the same order (describe_tags matches the id exactly: fnmatch patterns are anchored,
and instance ids hold no wildcard characters), in constant time.

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


_patch_tag_lookup()
sys.argv = ["localstack.runtime.main"]
runpy.run_module("localstack.runtime.main", run_name="__main__", alter_sys=True)
