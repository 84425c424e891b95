"""`specee serve` loads the model on a thread that ends before serving: OpenMP pools belong to the
thread that made them, and a pool left on the main thread slowed the scheduler thread's decoding
(libgomp throttles every pool once more threads sit in pools than there are cores)."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # loads the default model twice

SCRIPT = textwrap.dedent("""
    import argparse, os, time
    # Every core (a test worker keeps to one): pools of several threads, the CLI's default.
    os.sched_setaffinity(0, range(os.cpu_count()))
    import torch  # importing starts a thread of its own: count after it
    import specee
    from specee.cli.loading import load_off_main_thread

    def threads():
        return len(os.listdir("/proc/self/task"))

    def settled(count):
        # a pool's threads leave a moment after the thread that owned it
        deadline = time.monotonic() + 10
        while threads() != count and time.monotonic() < deadline:
            time.sleep(0.05)
        return threads()

    before = threads()
    args = argparse.Namespace(model=None, dtype="fp32", device="cpu", threads=None, quantization="none", cpu_tier=None, ctx_size=None,
                              compile=True)
    engine = load_off_main_thread(args)
    assert engine.context_length > 0
    after_serving_load = settled(before)
    specee.load(quantization="none")  # the same load on the main thread keeps a pool there
    time.sleep(1)
    print(before, after_serving_load, threads())
""")


def test_serving_load_leaves_no_openmp_pool_on_the_main_thread():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    before, after_serving_load, after_main_load = map(int, done.stdout.split()[-3:])
    assert after_serving_load == before
    assert after_main_load > before  # what the serving load avoids, seen in the same process
