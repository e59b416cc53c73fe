"""One real agent per test module of the framework integrations."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from servers import agent


@pytest.fixture(scope="module")
def agent_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with agent(tmp_path_factory.mktemp("agent"), "--no-nvml", "--series", "full") as url:  # every series, exactly
        yield url
