"""The CPU backend (dsforge.runtime.assemble.cpu_backend): CUDA calls redirected to the CPU, and a
loud refusal when a patched function is gone. Each test runs in a fresh interpreter, since the
backend patches the whole process."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def _python(script: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter: the CPU backend patches the whole process."""
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cpu_backend_fails_loudly_when_a_patch_target_disappears():
    """A Megatron-Core upgrade that renames a redirected function must not pass silently."""
    script = (
        "import megatron.core.transformer.moe.moe_utils as m\n"
        "del m.maybe_move_tensor_to_cpu\n"
        "from dsforge.runtime.assemble import cpu_backend\n"
        "try:\n"
        "    cpu_backend.activate()\n"
        "except cpu_backend.CpuBackendError as e:\n"
        "    print('refused:', e)\n")
    out = _python(script)
    assert "refused: megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu" in out.stdout


def test_cpu_backend_redirects_cuda_devices():
    script = (
        "import torch\n"
        "from dsforge.runtime.assemble import cpu_backend\n"
        "cpu_backend.activate()\n"
        "a = torch.empty(2, device=torch.cuda.current_device())\n"
        "b = torch.zeros(2, device='cuda').cuda()\n"
        "with torch.cuda.stream(torch.cuda.Stream()):\n"
        "    e = torch.cuda.current_stream().record_event()\n"
        "e.synchronize()\n"
        "torch.cuda.manual_seed(3); s = torch.cuda.get_rng_state()\n"
        "print(a.device, b.device, torch.equal(s, torch.get_rng_state()))\n")
    out = _python(script)
    assert out.stdout.strip().splitlines()[-1] == "cpu cpu True", out.stderr[-2000:]  # DeepSpeed logs to stdout
