"""`python -m workers.generate`: the in-process engine from the command line."""
import subprocess
import sys


def test_cli_prints_text_and_diffusion_metrics(tiny_nemotron):
    out = subprocess.run([sys.executable, "-m", "workers.generate", str(tiny_nemotron), "Hello world",
                          "--max-tokens", "40", "--temperature", "0", "--policy", "low_confidence",
                          "--max-denoising-steps", "8", "--ignore-eos"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "[40 tokens, finish_reason=length" in out
    assert "denoising_steps=16 " in out and "canvases=2 " in out  # 8 steps per canvas, two canvases
    assert "committed_per_denoising_step=4.000" in out


def test_cli_rejects_invalid_parameters_by_name(tiny_nemotron):
    r = subprocess.run([sys.executable, "-m", "workers.generate", str(tiny_nemotron), "x", "--mode", "linear_spec",
                        "--temperature", "0.5"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "temperature" in r.stderr and "linear_spec" in r.stderr
