"""launch.run's agent options (parallel/net/agents.py), validated before anything starts."""

import re

import pytest

from parallel.net.agents import AgentFault, max_restarts_from_config
from parallel.net.topology import NetConfigError


def test_an_agent_fault_names_a_node_that_can_be_replaced_and_a_step_the_run_reaches():
    assert AgentFault.from_config({"node": None, "at_step": 2}, nodes=2, steps=10) is None
    assert AgentFault.from_config({"node": 1, "at_step": 9}, nodes=2, steps=10) == AgentFault(1, 9)


@pytest.mark.parametrize("node,at_step,nodes,message", [
    (0, 2, 2, "agent_fault.node=0 must be a node 1..1: node 0's agent hosts the rendezvous store"),
    (2, 2, 2, "agent_fault.node=2 must be a node 1..1"),
    (True, 2, 2, "agent_fault.node=True must be a node 1..1"),
    (1, 10, 2, "agent_fault.at_step=10 must be a step the run reaches, 0..9"),
    (1, 2, 1, "agent_fault.node=1 needs an emulated network of at least 2 nodes (net.nodes=1)"),
])
def test_an_agent_fault_that_cannot_happen_is_refused(node, at_step, nodes, message):
    with pytest.raises(NetConfigError, match="^" + re.escape(message)):
        AgentFault.from_config({"node": node, "at_step": at_step}, nodes=nodes, steps=10)


@pytest.mark.parametrize("value,ok", [(0, True), (3, True), (-1, False), (True, False), ("2", False)])
def test_max_restarts_is_a_count(value, ok):
    if ok:
        assert max_restarts_from_config({"max_restarts": value}) == value
    else:
        with pytest.raises(NetConfigError, match=r"agent\.max_restarts=.* must be an integer >= 0"):
            max_restarts_from_config({"max_restarts": value})
