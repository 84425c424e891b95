"""The CLI's default thread count: physical cores, hyper-thread siblings counted once; and the
OpenMP spin between passes that `import specee` sets unless the user set one."""
import os
import subprocess
import sys

import specee
from specee.model.cores import physical_cores


def fake_topology(tmp_path, siblings: dict[int, str]):
    for cpu, listed in siblings.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(listed + "\n")
    return tmp_path


def test_hyper_thread_siblings_count_once(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    topology = fake_topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    assert physical_cores(topology) == 2


def test_only_the_cpus_this_process_may_use_count(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1, 2})
    topology = fake_topology(tmp_path, {0: "0", 1: "1", 2: "2", 3: "3"})
    assert physical_cores(topology) == 2


def test_without_topology_files_every_logical_cpu_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert physical_cores(tmp_path / "missing") == 3


def test_the_cli_runs_on_the_physical_cores_unless_told(monkeypatch):
    import argparse

    import specee
    import specee.cli.loading as cli_loading
    import specee.model.cores as cores

    seen = {}
    monkeypatch.setattr(cores, "physical_cores", lambda: 3)
    monkeypatch.setattr(specee, "load", lambda *args, **options: seen.update(options))
    monkeypatch.setattr(cli_loading, "load_line", lambda engine, seconds, threads_chosen: "")
    for given, expected in ((None, 3), (1, 1)):
        cli_loading.load(argparse.Namespace(model=None, dtype="fp32", device="cpu", threads=given, quantization="auto",
                                     compile=True, cpu_tier=None, ctx_size=None))
        assert seen["threads"] == expected


def spin_count_seen_by_a_new_process(env: dict) -> str:
    code = "import specee, os; print(os.environ['GOMP_SPINCOUNT'])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_openmp_threads_spin_between_passes_unless_the_user_says_otherwise():
    env = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
    assert spin_count_seen_by_a_new_process(env) == specee.SPIN_COUNT != "300000"
    assert spin_count_seen_by_a_new_process({**env, "GOMP_SPINCOUNT": "1000"}) == "1000"
