"""The benchmark scripts still run end to end (tiny workloads, a fresh database each run), and
the storage benchmark's own validity checks and dead-tuple census hold at that scale."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


#: the plots need matplotlib (the dev extra); CI installs without it
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

def run_script(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def storage_bench(module_fresh_db_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One run of the storage benchmark, whose report the tests below read."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = run_script("bench_storage.py", "--url", module_fresh_db_url, "--jobs", "300", "--threads", "3",
                      "--batch", "10", "--rounds", "1", "--idle-exit", "0.5", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.xdist_group("storage_bench")  # its module fixture runs the bench once
def test_storage_bench_drains_every_job_exactly_once_for_both_systems_and_phases(storage_bench):
    runs = {(r["system"], r["phase"]): r for r in storage_bench["results"]}
    assert set(runs) == {(s, p) for s in ("qstore", "classic") for p in ("clean", "pinned")}
    for r in runs.values():
        assert (r["drain"]["jobs"], r["drain"]["duplicates"], r["problems"]) == (300, 0, [])
    assert storage_bench["problems"] == []
    targets = storage_bench["summary"]["targets"]
    assert set(targets) == {"clean_drain_ratio", "pinned_drain_ratio", "copy_enqueue_jobs_per_s",
                            "pinned_dead_pct"}
    assert {t["result"] for t in targets.values()} <= {"PASS", "FAIL"}


@pytest.mark.xdist_group("storage_bench")  # its module fixture runs the bench once
def test_storage_bench_counts_no_dead_tuples_in_qstore_tables_under_a_pinned_horizon(storage_bench):
    if storage_bench["dead_tuple_source"] != "pgstattuple":
        pytest.skip("exact dead-tuple counts need pgstattuple on the server")
    runs = {(r["system"], r["phase"]): r for r in storage_bench["results"]}
    qstore = runs["qstore", "pinned"]["dead_tuples"]
    # the Alembic version row is rewritten by the install's upgrades; nothing else may be dead
    assert {name: f["dead"] for name, f in qstore.items()
            if f["dead"] and name != "qstore_alembic_version"} == {}
    # the classic queue leaves its update and its delete of every job behind the pin
    assert runs["classic", "pinned"]["dead_total"] == 2 * 300


def test_steady_bench_runs_all_three_phases_for_both_systems(fresh_db_url, tmp_path):
    out = tmp_path / "steady.json"
    proc = run_script("bench_steady.py", "--url", fresh_db_url, "--rate", "200", "--duration", "3",
                      "--workers", "2", "--sample", "0.5", "--json", str(out),
                      "--plot", str(tmp_path / "steady.png"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {"qstore": [], "classic": []}


def test_steady_bench_drives_qstore_through_its_worker_when_asked(fresh_db_url, tmp_path):
    out = tmp_path / "steady.json"
    proc = run_script("bench_steady.py", "--url", fresh_db_url, "--rate", "200", "--duration", "3",
                      "--workers", "2", "--sample", "0.5", "--qstore-driver", "worker",
                      "--json", str(out), "--plot", str(tmp_path / "steady.png"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["errors"] == {"qstore": [], "classic": []}
    assert data["qstore_worker_stats"]["completed"] > 0
    assert sum(s["qstore"]["completed_per_s"] or 0 for s in data["samples"]) > 0
    assert any(key.endswith(":runs") for key in data["qstore_maintenance"])


def bench_json(tmp_path: Path, script: str, *args: str) -> dict:
    """Run ``script`` with ``args`` and ``--json``; the run must exit 0 (valid)."""
    out = tmp_path / "out.json"
    proc = run_script(script, *args, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_natural_mode_drains_every_job_exactly_once_through_the_handler_with_the_horizon_pinned(
        fresh_db_url, tmp_path):
    data = bench_json(tmp_path, "bench_storage.py", "--mode", "natural", "--url", fresh_db_url,
                      "--phases", "pinned", "--jobs", "200", "--threads", "3", "--rounds", "1",
                      "--enqueue-seconds", "0.2", "--idle-exit", "0.3")
    runs = {r["system"]: r for r in data["results"]}
    assert set(runs) == {"qstore", "classic"}
    for r in runs.values():
        assert (r["drain"]["jobs"], r["drain"]["handled"], r["drain"]["duplicates"],
                r["drain"]["errors"], r["problems"]) == (200, 200, 0, {}, [])
        assert r["single_enqueue"]["jobs"] > 0
        assert isinstance(r["pinned_xid"], int)  # the drain ran under a pinned horizon
    # the census counts the classic queue's claim update and delete of every drained job (its
    # warm-up rows were vacuumed away before the drain)
    assert runs["classic"]["dead_total"] == 2 * 200
    results = {k: v["result"] for k, v in data["summary"]["targets"].items()}
    assert set(results) == {"single_enqueue_ratio", "natural_clean_drain_ratio",
                            "natural_pinned_drain_ratio", "natural_pinned_drain_ratio_100k"}
    assert results["natural_clean_drain_ratio"] == "SKIP"  # no clean phase in this run
    assert results["natural_pinned_drain_ratio_100k"] == "SKIP"  # 200 jobs, not 100,000
    assert {results["single_enqueue_ratio"], results["natural_pinned_drain_ratio"]} <= {"PASS", "FAIL"}


def test_steady_mode_wakes_workers_by_notify_and_picks_up_every_job_exactly_once(
        fresh_db_url, tmp_path):
    # a 30 s polling fallback: a job picked up within the run was picked up on a notification
    data = bench_json(tmp_path, "bench_storage.py", "--mode", "steady", "--url", fresh_db_url,
                      "--phases", "pinned", "--rate", "100", "--duration", "1",
                      "--steady-warmup", "0.2", "--workers", "2", "--poll-interval", "30")
    runs = {r["system"]: r for r in data["results"]}
    assert set(runs) == {"qstore", "classic"}
    for r in runs.values():
        assert r["enqueued_total"] > 0
        assert (r["missing"], r["duplicates"], r["completed"], r["errors"], r["problems"]) == (
            0, 0, r["enqueued_total"], {}, [])
        # one notification per enqueue commit, and no wait ran into the polling fallback
        assert (r["notifications"], r["wakes_poll"]) == (r["enqueued_total"], 0)
        assert r["pickup_ms"]["n"] == r["enqueued"]
    targets = data["summary"]["targets"]
    assert targets["clean_pickup_p95_ms"]["result"] == "SKIP"
    assert targets["pinned_pickup_p95_ms"]["result"] in {"PASS", "FAIL"}


def test_steady_bench_counts_what_the_maintainer_leaves_dead_under_the_pinned_horizon(
        fresh_db_url, tmp_path):
    # rotate the queue ring ten times a second and vacuum five times a second: rotations and
    # prunes while pinned must leave no dead ring bookkeeping rows behind (no VACUUM could
    # remove them before the census). The 3-second pin is shorter than the counter rollup's
    # default grace (a snapshot counts as a pin after 5 s), so a rollup landing in the pin
    # would fold by design; the test lowers the grace to 1 ms to hold the rollup to the pin.
    data = bench_json(tmp_path, "bench_steady.py", "--url", fresh_db_url, "--rate", "100",
                      "--workers", "2", "--clean-seconds", "1", "--pinned-seconds", "3",
                      "--recovery-seconds", "1", "--sample", "0.5", "--vacuum-interval", "0.2",
                      "--schedule", "queue_ring_every=0.1", "--schedule", "rollup_pinned_after=0.001",
                      "--plot", str(tmp_path / "s.png"))
    assert data["errors"] == {"qstore": [], "classic": []}
    assert data["upkeep"]["kind"] == "maintainer"
    ran = data["qstore_maintenance"]
    assert ran["queue_ring:runs"] > 0 and ran.get("queue_ring:rotate:rotated", 0) > 0
    assert not [k for k in ran if k.endswith(":errors")]
    census = data["dead_tuple_census"]
    # still pinned once counted: no VACUUM could have removed what the pinned phase left
    assert census["end_of_pinned"]["pin_held"] is True
    end = census["end_of_pinned"]["steady_qstore"]
    assert end["total"] == sum(t["dead"] for t in end["tables"].values())
    upkeep = data["verdict"]["upkeep_dead_end_of_pinned"]
    assert upkeep["value"] == end["total"]
    assert upkeep["result"] in {"PASS", "FAIL"}
    assert upkeep["pinned_seconds"] >= 3
    if not census["source"].startswith("pgstattuple"):
        pytest.skip("exact dead-tuple counts need pgstattuple on the server")
    assert upkeep["result"] == "PASS"
    assert not [name for name, t in end["tables"].items()
                if t["dead"] and ("ring" in name or "rollup" in name or "counter" in name)]


def test_worker_bench_drains_every_job_with_each_variant(fresh_db_url, tmp_path):
    out = tmp_path / "worker.json"
    proc = run_script("bench_worker_variants.py", "--url", fresh_db_url, "--jobs", "200",
                      "--concurrency", "4", "--pickup-samples", "5", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {r["variant"] for r in data["results"]} == {"loop", "plain", "claimers", "batch10", "prefetch", "async"}
    assert all((r["terminal"], r["running_left"]) == (200, 0) for r in data["results"])
    assert data["pickup"]["n"] == 5


def clean_drain(url: str, tmp_path: Path, jobs: int, *extra: str) -> tuple[dict[str, Any], str]:
    """``bench_worker.py``'s clean drain of ``jobs`` jobs (concurrency 4, the psycopg classic
    queue beside the worker, no storage loop, no accounting run) with ``extra`` arguments:
    its JSON report's ``drain`` part and its output."""
    out = tmp_path / "drain.json"
    proc = run_script("bench_worker.py", "--url", url, "--mode", "drain", "--jobs", str(jobs),
                      "--concurrency", "4", "--phases", "clean", "--classics", "psycopg", "--skip-storage",
                      "--account-jobs", "0", *extra, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())["drain"], proc.stdout


def test_worker_bench_loads_the_drain_into_as_many_lanes_as_asked(fresh_db_url, tmp_path):
    report, _ = clean_drain(fresh_db_url, tmp_path, 200, "--load-lanes", "4")
    [worker] = [r for r in report["results"] if r["system"] == "worker"]
    assert (worker["lanes"], worker["drain"]["jobs"], worker["problems"]) == (4, 200, [])


def test_worker_bench_samples_the_backends_states_of_each_drain_when_asked(fresh_db_url, tmp_path):
    report, stdout = clean_drain(fresh_db_url, tmp_path, 2000, "--wait-states")
    drained = report["results"]
    assert {r["system"] for r in drained} == {"classic_pg", "worker"}
    for r in drained:
        waits = r["server"]["waits"]
        assert waits["samples"] > 0 and set(waits["mean_backends"]) == set(bench_lib().WAIT_STATES), r["system"]
        # the drain's own backends ran statements while it was sampled
        assert waits["mean_backends"]["on_cpu"] > 0, (r["system"], waits)
    assert "The database's backends during each drain, by state" in stdout


@pytest.mark.parametrize(("row", "state"), [
    (("active", None, None), "on_cpu"),
    (("active", "IO", "WALSync"), "wal_flush"),
    (("active", "LWLock", "WALWrite"), "wal_flush"),
    (("active", "Lock", "transactionid"), "lock_row"),
    (("active", "Lock", "tuple"), "lock_row"),
    (("active", "Lock", "relation"), "lock_relation"),
    (("active", "Lock", "advisory"), "lock_other"),
    (("active", "LWLock", "BufferContent"), "lwlock"),
    (("active", "IO", "DataFileRead"), "io"),
    (("active", "Client", "ClientRead"), "other"),
    (("idle in transaction", "Client", "ClientRead"), "client_in_xact"),
    (("idle", "Client", "ClientRead"), None),
])
def test_a_sampled_backend_is_counted_in_the_state_its_row_shows(row, state):
    assert bench_lib().wait_state(*row) == state


def bench_lib():
    """``scripts/_benchlib.py``, imported as the scripts import it."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import _benchlib

    return _benchlib


def test_worker_bench_drains_through_the_worker_beside_both_classic_queues_and_the_storage_loop(
        fresh_db_url, tmp_path):
    out = tmp_path / "worker_vs.json"
    proc = run_script("bench_worker.py", "--url", fresh_db_url, "--jobs", "300", "--concurrency", "4",
                      "--rates", "50", "--duration", "1", "--warmup", "0.2", "--enqueue-seconds", "0.3",
                      "--account-jobs", "200", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    drained = data["drain"]["results"]
    systems = ("classic", "classic_pg", "storage", "worker")
    assert {(r["system"], r["phase"]) for r in drained} == {
        (s, p) for s in systems for p in ("clean", "pinned")}
    assert all(r["drain"]["jobs"] == 300 and not r["problems"] for r in drained)
    assert [r["lanes"] for r in drained if r["system"] == "worker"] == [1, 1]  # one COPY, one lane
    for r in drained:  # the server's and the client's cost, per job
        d = r["drain"]
        assert d["wal_bytes_per_job"] > 0 and d["server_xacts_per_job"] > 0, (r["system"], d)
        assert d["client_cpu_us_per_job"] > 0 and d["server_active_us_per_job"] >= 0, (r["system"], d)
        if r["system"] in ("worker", "classic_pg"):  # its start-up and its rate once under way
            assert d["first_job_ms"] >= 0 and d["steady_jobs_per_s"] > 0, (r["system"], d)
    # the classic queues leave their claim's update and their delete of every job behind the pin
    pinned = {r["system"]: r for r in drained if r["phase"] == "pinned"}
    assert pinned["classic_pg"]["dead_total"] == pinned["classic"]["dead_total"] == 2 * 300
    ratios = data["drain"]["summary"]["ratios"]
    for phase in ("clean", "pinned"):  # against the faster classic queue of the phase
        rr = ratios[phase]
        assert rr["vs_classic"] == min(rr["vs_each"].values()), rr
        assert rr["steady_vs_classic"] > 0, rr
    accounted = {r["system"]: r for r in data["drain"]["accounting"]}
    assert set(accounted) == set(systems)
    # a classic loop is one claim and one DELETE per 10 jobs (plus its few empty claims)
    assert 0.2 <= accounted["classic_pg"]["round_trips_per_job"] < 0.3
    assert all(r["round_trips_per_job"] > 0 for r in accounted.values())
    picked = data["pickup"]["results"]
    assert {(r["system"], r["phase"]) for r in picked} == {
        (s, p) for s in ("classic", "classic_pg", "worker") for p in ("clean", "pinned")}
    assert all(r["enqueued"] > 0 and not r["problems"] for r in picked)
    for r in picked:  # each pickup of the worker and the psycopg classic, split into its parts
        if r["system"] in ("worker", "classic_pg"):
            split = r["split"]
            assert all(split[f"{part}_ms"]["n"] == r["pickup_ms"]["n"]
                       for part in ("claim_wait", "claim_trip", "handoff")), (r["system"], split)
            assert split["claim_trip_ms"]["p50_ms"] > 0 and split["claim_wait_ms"]["p50_ms"] >= 0, split
        if r["system"] != "worker":
            continue
        overlap = r["tail_overlap"]  # the maintainer's runs during the phase, lined up with the pickups
        assert overlap["promote"]["runs"] >= 2  # every 0.25 s by default
        assert all(0.0 <= o["all_share"] <= 1.0 and 0.0 <= o["tail_share"] <= 1.0 for o in overlap.values())
    assert set(data["pickup"]["summary"]["targets"]) == {
        "pickup_p95_vs_classic_50_clean", "pickup_p95_vs_classic_50_pinned"}
    enqueued = data["enqueue"]["results"]
    assert {(r["system"], r["phase"]) for r in enqueued} == {
        (s, p) for s in ("classic", "classic_pg", "defer") for p in ("clean", "pinned")}
    assert all(r["single_enqueue"]["jobs"] > 0 for r in enqueued)
    assert {t["result"] for t in data["enqueue"]["summary"]["targets"].values()} <= {"PASS", "FAIL"}


def test_worker_bench_with_async_runs_the_async_worker_beside_the_worker(fresh_db_url, tmp_path):
    report, _ = clean_drain(fresh_db_url, tmp_path, 300, "--async")
    drained = {r["system"]: r for r in report["results"]}
    assert set(drained) == {"classic_pg", "worker", "async_worker"}
    assert drained["async_worker"]["drain"]["jobs"] == 300 and not drained["async_worker"]["problems"]
    assert report["summary"]["ratios"]["clean"]["async_vs_worker"] > 0


def test_psycopg_classic_queue_drains_every_job_exactly_once_with_each_driver_and_claim(
        fresh_db_url, tmp_path):
    out = tmp_path / "classic_pg.json"
    proc = run_script("classic_psycopg.py", "--url", fresh_db_url, "--jobs", "300", "--workers", "4",
                      "--compare", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert {(r["driver"], r["claim"]) for r in results} == {
        (d, c) for d in ("asyncio", "threads") for c in ("update", "select")}
    assert all(r["problems"] == [] and r["jobs_per_s"] > 0 for r in results)


def test_mix_bench_ends_every_job_as_planned_exactly_once_in_both_systems(fresh_db_url, tmp_path):
    out, png = tmp_path / "mix.json", tmp_path / "mix.png"
    proc = run_script("bench_mix.py", "--url", fresh_db_url, "--minutes", "0.3", "--rate", "100",
                      "--max-delay", "3", "--max-snooze", "2", "--vacuum-interval", "2",
                      "--producers", "2", "--classic-workers", "4", "--json", str(out),
                      *(["--plot", str(png)] if HAS_MATPLOTLIB else []))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["problems"] == []
    for name in ("qstore", "classic"):
        r = data["systems"][name]
        assert r["enqueued"] > 1000  # 100 jobs/s for 18 s
        # every kind of the mix was enqueued, and every job completed once after its planned runs
        assert set(r["enqueued_by_kind"]) == {"plain", "delayed", "retry", "snooze", "unique", "progress"}
        assert r["completions"] == r["completed_jobs"] == r["enqueued"]
        assert r["handler_runs"] == r["planned_runs"] > r["enqueued"]
        assert r["planned_runs_ok"] is True
        assert len(r["minutes"]) == 10 and {m["phase"] for m in r["minutes"]} >= {"clean", "pinned", "after"}
        assert set(r["targets"]) == {"dead_per_job_pinned", "bytes_after_over_before",
                                     "last_pinned_minute_over_clean", "promotion_lag_p95_s"}
        assert {t["result"] for t in r["targets"].values()} <= {"PASS", "FAIL"}
    assert data["systems"]["qstore"]["leftovers"]["terminal"] == data["systems"]["qstore"]["enqueued"]
    assert data["systems"]["classic"]["leftovers"] == {"rows": 0}
    assert data["census"]["end_of_pin"]["pin_held"] is True
    report = proc.stdout
    for header in ("qstore: dead tuples", "classic: dead tuples", *data["report_columns"], "MiB",
                   *(f"dead {f}" for f in data["families"]["qstore"]), "dead jobs"):
        assert header in report, header
    assert not HAS_MATPLOTLIB or png.stat().st_size > 0


def test_mix_bench_refuses_a_plot_without_matplotlib_before_starting(fresh_db_url, tmp_path):
    # a directory on the path whose matplotlib cannot be imported
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_mix.py"), "--url", fresh_db_url,
                           "--plot", str(tmp_path / "x.png")], cwd=ROOT, text=True, capture_output=True,
                          timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(shadow.parent)})
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "matplotlib" in proc.stderr
    assert not (tmp_path / "x.png").exists()


def test_dead_tuple_census_finds_no_dead_tuple_of_a_delayed_qstore_job_and_each_classic_write(fresh_db_url, tmp_path):
    data = bench_json(tmp_path, "dead_tuples_per_job.py", "--url", fresh_db_url, "--jobs", "40",
                      "--kinds", "plain,delayed")
    if not data["dead_tuple_source"].startswith("pgstattuple"):
        pytest.skip("exact dead-tuple counts need pgstattuple on the server")
    runs = {r["kind"]: r for r in data["results"]}
    assert all(r["ok"] and r["pin_held"] for r in runs.values())
    # the classic row is updated by its claim and deleted by its completion, delayed or not
    assert runs["plain"]["classic"] == runs["delayed"]["classic"] == {"jobs": {"made": 80, "left": 80}}
    # qstore: a plain job leaves nothing, nor does a delayed one (its wait is a wheel entry and
    # a mark, both appended) (the install's own version row can show as updated when its
    # statistics arrive late: what counts is what is left dead under the pin)
    def left(kind: str) -> dict[str, dict[str, int]]:
        return {t: c for t, c in runs[kind]["qstore"].items() if c["left"]}

    assert left("plain") == {}
    assert left("delayed") == {}


def schemas_named(url: str, where: str) -> list[str]:
    """The schemas of the database at ``url`` whose ``nspname`` matches ``where`` (SQL)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(f"SELECT nspname FROM pg_namespace WHERE {where}")).scalars())
    finally:
        engine.dispose()


def test_defer_client_bench_times_every_case_of_each_tree_and_drops_its_schemas(fresh_db_url, tmp_path):
    out = tmp_path / "defer.json"
    tree = str(ROOT)
    proc = run_script("bench_defer_client.py", "--url", fresh_db_url, "--tree", f"a={tree}", "--tree", f"b={tree}",
                      "--rounds", "2", "--calls", "20", "--warm", "5", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["figures"]) == {"a", "b"} and len(report["rounds"]["a"]) == 2
    for cases in report["figures"].values():
        assert set(cases) == {"defer", "defer_kept", "enqueue", "raw", "classic"}
        assert all(c["cpu_us"] > 0 and c["calls_per_s"] > 0 for c in cases.values())
        # the server runs on this host: each case's backends are read from /proc
        assert all(c["server_cpu_us"] > 0 for c in cases.values()), cases
    assert schemas_named(fresh_db_url, "nspname IN ('qstore_defer_client_bench', 'bench_defer_client_classic')") == []


def test_claim_server_bench_claims_one_job_per_loop_in_every_system_and_drops_its_schemas(fresh_db_url):
    proc = run_script("bench_claim_server.py", "--url", fresh_db_url, "--rounds", "1", "--jobs", "20")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if "the classic claim" in line]
    assert [r.split("  ")[0] for r in rows] == ["classic (psycopg)", "qstore (default lanes)", "qstore (1 lane)"]
    assert schemas_named(fresh_db_url, "nspname LIKE 'bench_claim_%'") == []


@pytest.mark.parametrize("revision", ["0010", "0017"])  # 0017's text names the slot-seen setting
def test_claim_server_bench_also_runs_the_claim_of_an_earlier_revision(fresh_db_url, revision):
    proc = run_script("bench_claim_server.py", "--url", fresh_db_url, "--rounds", "1", "--jobs", "20",
                      "--also-claim-of", revision)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if "the classic claim" in line]
    assert [r.split("  ")[0] for r in rows][3:] == [f"qstore (default lanes), {revision}",
                                                   f"qstore (1 lane), {revision}"]
    assert schemas_named(fresh_db_url, "nspname LIKE 'bench_claim_%'") == []


def test_claim_server_bench_refuses_a_revision_without_a_claim_text() -> None:
    proc = run_script("bench_claim_server.py", "--also-claim-of", "0009")
    assert proc.returncode == 2 and "revision '0009' has no frozen claim_ready text" in proc.stderr


def test_async_calls_bench_times_every_case_and_drops_its_schema(fresh_db_url, tmp_path):
    out = tmp_path / "async_calls.json"
    proc = run_script("bench_async_calls.py", "--url", fresh_db_url, "--calls", "10", "--blocks", "2",
                      "--warm", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures) == {"enqueue", "claim", "enqueue_in_tx", "claim_in_tx"}
    assert all(f["cpu_us"] > 0 and f["calls_per_s"] > 0 for f in figures.values())
    assert schemas_named(fresh_db_url, "nspname LIKE 'qstore_async_calls_%'") == []


def test_trickle_cycle_bench_reads_the_claiming_backends_cpu_and_plans_and_drops_its_schema(fresh_db_url, tmp_path):
    out = tmp_path / "trickle.json"
    proc = run_script("bench_trickle_cycle.py", "--url", fresh_db_url, "--cycles", "20", "--blocks", "2",
                      "--warm", "10", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["backend_cpu_us"] >= 0 and figures["call_p50_us"] > 0 and len(figures["blocks_cpu_us"]) == 2
    # the cycle's statement, once the driver prepares it (after its first five runs): five
    # custom plans, then the generic one for every later call
    assert (figures["custom_plans"], figures["generic_plans"]) == (5, 10 + 2 * 20 - 1 - 5 - 5)
    assert schemas_named(fresh_db_url, "nspname LIKE 'qstore_trickle_%'") == []



def test_counts_bench_times_the_counts_on_a_claimed_backlog_and_drops_its_schema(fresh_db_url, tmp_path):
    out = tmp_path / "counts.json"
    proc = run_script("bench_counts.py", "--url", fresh_db_url, "--jobs", "60", "--claimed", "25", "--claim-batch", "5", "--lanes", "2",
                      "--rounds", "2", "--lookups", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert (figures["claim_ranges"], figures["available"]) == (5, 35)
    assert all(figures[f"{k}_ms"] > 0 for k in ("queue_counts", "per_row_lookup", "age_waiting_priorities",
                                                 "age_waiting_priorities_all_old", "load_job_completed",
                                                 "load_job_available"))
    assert schemas_named(fresh_db_url, "nspname LIKE 'qstore_counts_%'") == []


def test_worker_bench_splits_the_async_workers_pickups_too(fresh_db_url, tmp_path):
    out = tmp_path / "async_pickup.json"
    proc = run_script("bench_worker.py", "--url", fresh_db_url, "--concurrency", "4", "--mode", "pickup",
                      "--async", "--phases", "clean", "--classics", "psycopg", "--rates", "50",
                      "--duration", "1", "--warmup", "0.2", "--rounds", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    picked = {r["system"]: r for r in json.loads(out.read_text())["pickup"]["results"]}
    assert set(picked) == {"classic_pg", "worker", "async_worker"}
    for system, r in picked.items():  # each pickup split into its parts, whichever runtime claimed it
        split = r["split"]
        assert split["claim_trip_ms"]["n"] == r["pickup_ms"]["n"] > 0, (system, split)
        assert split["handoff_ms"]["p50_ms"] is not None, (system, split)

def test_wal_per_batch_facts_measures_both_designs_for_every_batch_size(fresh_db_url, tmp_path):
    out = tmp_path / "wal_facts.json"
    proc = run_script("wal_per_batch_facts.py", "--url", fresh_db_url, "--jobs", "256", "--batches", "1,32",
                      "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = {(r["system"], r["batch"]): r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {(s, b) for s in ("qstore", "per_batch", "classic_pg") for b in (1, 32)}
    assert all(r["jobs"] == 256 for r in results.values())
    # qstore's drain completed every job, in one call per batch (plus the last, empty, claim)
    assert results["qstore", 32]["jobs"] == 256 and results["qstore", 32]["calls"] == 256 // 32 + 1
    # per job, qstore writes a receipt, a closure and a done row; the sketch a share of one row of each
    assert results["per_batch", 32]["wal_bytes_per_job"] < results["qstore", 32]["wal_bytes_per_job"] / 3
    assert results["per_batch", 32]["wal_bytes_per_job"] < results["per_batch", 1]["wal_bytes_per_job"]
    # the classic queue's UPDATE and DELETE are per job whatever the batch
    assert results["classic_pg", 32]["wal_bytes_per_job"] > results["per_batch", 32]["wal_bytes_per_job"]
