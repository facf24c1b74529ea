"""A real LiteLLM proxy process from .venv-litellm (.ci/ensure-litellm builds it), served by
uvicorn on a listening socket the test holds (`--fd`), so its port cannot be taken meanwhile."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.ports import listener, port_of

REPO = Path(__file__).resolve().parents[3]
VENV = Path(os.environ.get("KVP_TEST_LITELLM_VENV", REPO / ".venv-litellm"))
READY_TIMEOUT_SECONDS = 120.0


def litellm_python() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"no LiteLLM venv at {VENV}: run `bash .ci/ensure-litellm` (make test does), "
            "which builds it with litellm[proxy] and the client's litellm extra"
        )
    return python


class LiteLLMProxy:
    def __init__(self, work_dir: Path, config: dict[str, Any], env: dict[str, str]) -> None:
        self.work_dir = work_dir
        self.config_path = work_dir / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.master_key = "sk-" + secrets.token_hex(24)
        self.sock = listener()
        self.url = f"http://127.0.0.1:{port_of(self.sock)}"
        self.log_path = work_dir / "proxy.log"
        self.extra_env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        python = litellm_python()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVP", "LITELLM"))}
        env.update(
            {
                "CONFIG_FILE_PATH": str(self.config_path),
                "LITELLM_MASTER_KEY": self.master_key,
                # No fetch of the model cost map from the network at import.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "PYTHONUNBUFFERED": "1",
                **self.extra_env,
            }
        )
        fd = self.sock.fileno()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(python), "-m", "uvicorn", "litellm.proxy.proxy_server:app", "--fd", str(fd)],
                cwd=self.work_dir,
                env=env,
                pass_fds=[fd],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy was not ready in time:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health/liveliness", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def chat(
        self,
        content: str,
        *,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
        **body: Any,
    ) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {self.master_key}", **(headers or {})},
            json={"model": "tiny", "messages": [{"role": "user", "content": content}], **body},
            timeout=timeout,
        )

    def log(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgid(self.proc.pid), signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.sock.close()
