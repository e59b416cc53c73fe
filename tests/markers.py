"""Skip markers for tests that need a real binary (the tests start the real one, never a fake)."""

from __future__ import annotations

import pytest

from servers import ALERTMANAGER, PROMETHEUS, PROMTOOL

needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus binary not installed")
needs_alertmanager = pytest.mark.skipif(ALERTMANAGER is None, reason="alertmanager binary not installed")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
