"""The agent's own counters: written when a count moved, labels escaped."""

from __future__ import annotations

import socket

from exposition_check import Watched, assert_clean, text, value
from trainpatrol import __version__
from trainpatrol.agent.stats import AgentStats


def test_counts_are_written_when_one_moved() -> None:
    stats = Watched(AgentStats("agent"))
    assert stats.changed()
    first = text(stats)
    assert not stats.changed()
    assert value(first, "trainpatrol_pushes_total", {"outcome": "ok"}) == 0.0
    assert value(first, "trainpatrol_agent_info", {"version": __version__, "host": socket.gethostname(),
                                                   "mode": "agent"}) == 1.0
    stats.count("pushes", "ok")
    stats.count("commands", ("pause", 'odd "source" \\ \n'))
    assert stats.changed()
    after = text(stats)
    assert value(after, "trainpatrol_pushes_total", {"outcome": "ok"}) == 1.0
    assert value(after, "trainpatrol_control_commands_total", {"action": "pause", "source": 'odd "source" \\ \n'}) \
        == 1.0
    assert b'source="odd \\"source\\" \\\\ \\n"' in after
    assert_clean(after)
