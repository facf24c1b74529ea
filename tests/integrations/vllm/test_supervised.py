"""A dead vLLM intake, in the real service process: counted, logged, started again, and /readyz
says 503 until it runs. The death is real (an exception out of the intake's loop); what raises
it is a patch the test's wrapper script puts on the subscriber while a file exists."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.integrations.vllm.publisher import FramePublisher
from tests.integrations.vllm.service import Service, wait_for
from tests.integrations.vllm.test_attacks import batch, holds

pytestmark = pytest.mark.slow

WRAPPER = """
import os
import sys

from app.ingest.vllm import subscriber

FAULT = {fault!r}
Subscriber = subscriber.VllmSubscriber
real_open, real_follow = Subscriber._open, Subscriber._follow


def faulty_open(self, ep):
    if os.path.exists(FAULT):
        raise RuntimeError("injected: the intake cannot open its sockets")
    return real_open(self, ep)


def faulty_follow(self, s):
    if os.path.exists(FAULT):
        raise RuntimeError("injected: the intake dies")
    return real_follow(self, s)


Subscriber._open, Subscriber._follow = faulty_open, faulty_follow
from kvprefetch_cli import main

sys.argv[0] = "kvprefetch"
main()
"""


def readiness(service: Service) -> tuple[int, str | None]:
    r = httpx.get(f"{service.url}/readyz", timeout=30)
    return r.status_code, r.json().get("vllm_intake")


def test_a_dead_intake_is_restarted_and_readyz_says_so_meanwhile(tmp_path: Path) -> None:
    fault = tmp_path / "fault"
    wrapper = tmp_path / "serve.py"
    wrapper.write_text(WRAPPER.format(fault=str(fault)))
    pub = FramePublisher()
    service = Service(tmp_path / "svc", {"KVP_VLLM_KV_ENDPOINTS": pub.spec("gpu-0")}, wrapper)
    try:
        service.wait_ready("/readyz")
        assert readiness(service) == (200, "running")
        time.sleep(0.5)
        pub.publish(batch(0, [1]))
        wait_for(lambda: holds(service, "gpu-0", 1), "batch 0")

        fault.touch()
        pub.publish(batch(1, [2]))  # the loop dies on it, and cannot start again meanwhile
        wait_for(lambda: service.metric("kvprefetch_vllm_intake_deaths_total") >= 2, "deaths")
        assert readiness(service) == (503, "dead (restarting)")
        assert "the vLLM intake of gpu-0 died" in service.log()

        fault.unlink()
        wait_for(lambda: readiness(service) == (200, "running"), "the intake running again")
        # Batch 1, sent while it was dead, comes from the replay buffer; the stream goes on.
        wait_for(lambda: holds(service, "gpu-0", 2), "batch 1, replayed")
        pub.publish(batch(2, [3]))
        wait_for(lambda: holds(service, "gpu-0", 3), "batch 2")

        took = service.terminate()
        print(f"\nSIGTERM to exit {took:.2f} s")
        assert service.proc.returncode in (0, -signal.SIGTERM)
        assert "the vLLM intake of gpu-0 stopped" in service.log()
    finally:
        service.kill()
        pub.close()
