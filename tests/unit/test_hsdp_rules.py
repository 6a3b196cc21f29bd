"""HSDP's refusals: each before any process group, in one line naming the value and the fix."""

import pytest
from test_layout import plan_for

from parallel.dist.dims import LayoutError
from parallel.spec import ConfigError


@pytest.mark.parametrize("world,overrides,error,message", [
    (4, ["parallel=hsdp", "parallel.dp_shard=1"], LayoutError,
     r"^parallel.dp_shard=1 shards the model state over one rank.*use parallel.dp_shard=2 or more"),
    (4, ["parallel=hsdp_zero2", "parallel.dp_shard=4"], LayoutError,
     r"^parallel.dp_shard=4 = parallel.dp=4 leaves one shard group.*parallel.dp_shard=2\), or parallel=zero3"),
    (4, ["parallel=torch_hsdp", "parallel.dp_shard=3"], LayoutError,
     r"^parallel.dp_shard=3 does not divide parallel.dp=4: .*\(e.g. parallel.dp_shard=2\)$"),
    (4, ["parallel=hsdp", "parallel.dp_shard=0"], LayoutError, r"^parallel.dp_shard=0 must be a positive integer$"),
    (2, ["parallel=hsdp"], LayoutError, r"^parallel=hsdp shards the model state .* at least 4 processes"),
    (4, ["parallel=zero3", "parallel.dp_shard=2"], LayoutError,
     r"^parallel=zero3 does not split along dp_shard: set parallel.dp_shard=1$"),
    (4, ["parallel=hsdp", "parallel.zero=1"], ConfigError, r"^parallel.zero=1 sets the ZeRO stage .* parallel=hsdp"),
])
def test_hsdp_refusals(world, overrides, error, message):
    with pytest.raises(error, match=message):
        plan_for(world, *overrides)


@pytest.mark.parametrize("preset", ["hsdp", "hsdp_zero2", "torch_hsdp"])
def test_hsdp_plans_on_two_shard_groups(preset):
    plan = plan_for(4, f"parallel={preset}", "parallel.dp_shard=2")
    assert (plan.strategy, plan.dims.dp, plan.dims.dp_shard) == (preset, 4, 2)
    assert plan.dims.groups_in_use() == ("dp_shard", "dp_replicate")
