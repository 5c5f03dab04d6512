"""Memory readings (parsers over the tools' text, probes), the gate's judgement, sizes,
the tokens/s window and the liveness verdict: pure logic, any OS."""

from __future__ import annotations

import json
import sys

import pytest

from protocol import Heartbeat
from supervisor.config import Config, size
from supervisor.memory.gate import MemoryGate
from supervisor.workers.liveness import Liveness
from supervisor.workers.states import ExitCause
from supervisor.memory.probe import (CRITICAL, NORMAL, WARN, FileProbe, MemoryReading, SystemProbe,
                               parse_macos_pressure, parse_psi, psi_level, worse)
from supervisor.workers.throughput import TokenRate

GiB = 1 << 30


@pytest.mark.parametrize("text,level", [
    ("kern.memorystatus_vm_pressure_level: 1\n", NORMAL),
    ("kern.memorystatus_vm_pressure_level: 2", WARN),
    ("4\n", CRITICAL),                      # `sysctl -n`
    ("kern.memorystatus_vm_pressure_level: 3", None),  # not a level the kernel defines
    ("sysctl: unknown oid", None),
    ("", None),
])
def test_macos_pressure_level(text, level):
    assert parse_macos_pressure(text) == level


PSI_CALM = ("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
PSI_STALLS = ("some avg10=23.50 avg60=10.00 avg300=2.00 total=123456\n"
              "full avg10=4.25 avg60=1.00 avg300=0.10 total=4567\n")
PSI_THRASH = ("some avg10=80.00 avg60=70.00 avg300=50.00 total=9999999\n"
              "full avg10=35.10 avg60=20.00 avg300=9.00 total=999999\n")


def test_linux_psi_parsing_and_levels():
    psi = parse_psi(PSI_STALLS)
    assert (psi.some_avg10, psi.full_avg10) == (23.5, 4.25)
    assert psi_level(parse_psi(PSI_CALM)) == NORMAL
    assert psi_level(psi) == WARN
    assert psi_level(parse_psi(PSI_THRASH)) == CRITICAL
    assert parse_psi("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n").full_avg10 is None
    assert parse_psi("garbage") is None and psi_level(None) is None
    assert parse_psi("some avg10=x avg60=0 avg300=0 total=0") is None


def test_worse_pressure():
    assert worse(None, WARN) == WARN and worse(CRITICAL, NORMAL) == CRITICAL
    assert worse(NORMAL, None) == NORMAL


def test_system_probe_reads_this_machine_and_fails_soft_elsewhere():
    r = SystemProbe()()
    assert 0 < r.available_bytes <= r.total_bytes
    if sys.platform.startswith("linux") and SystemProbe.PSI_PATH.exists():
        assert r.pressure in (NORMAL, WARN, CRITICAL)
    if sys.platform != "darwin":
        # The macOS reader on another OS: sysctl has no such key (or is missing).
        assert SystemProbe(platform="darwin")().pressure is None
    assert SystemProbe(platform="sunos")().pressure is None


def test_file_probe_overrides_what_it_names_and_is_reread(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"available_bytes": 3 * GiB}))
    base = MemoryReading(10 * GiB, 16 * GiB, NORMAL, "base")
    probe = FileProbe(path, fallback=lambda: base)
    r = probe()
    assert (r.available_bytes, r.total_bytes, r.pressure) == (3 * GiB, 16 * GiB, NORMAL)
    path.write_text(json.dumps({"available_bytes": 5 * GiB, "pressure": CRITICAL}))
    r = probe()
    assert (r.available_bytes, r.pressure) == (5 * GiB, CRITICAL)
    path.write_text("{not json")
    assert probe() == base  # unreadable: the system's readings, never a crash


def gate(tmp_path, **cfg) -> MemoryGate:
    return MemoryGate(Config(state_dir=tmp_path, **cfg), probe=lambda: None)


def test_need_is_weights_on_disk_times_factor_plus_kv_budget(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text("{}")
    for name, n in (("model-00001-of-00002.safetensors", 3000), ("model-00002-of-00002.safetensors", 1000),
                    ("tokenizer.json", 50_000)):  # not weights
        (m / name).write_bytes(b"\0" * n)
    g = gate(tmp_path, memory_factor=1.5, kv_budget=100)
    assert g.need(str(m)) == 6100
    assert g.need(str(tmp_path / "absent")) == 100  # unknown size: the KV budget alone
    # A worker group with 1 of its 3 ranks here: a third of the weights, one KV budget;
    # 2 of 4 here: half, and two budgets.
    assert g.need(str(m), (1, 3)) == 2000 + 100
    assert g.need(str(m), (2, 4)) == 3000 + 200


def test_the_gate_counts_this_hosts_share_of_a_group_and_a_bad_hostfile_stops_mlxd(tmp_path,
                                                                                   capsys):
    import json as _json

    from protocol.hosts import local_share, read_hostfile
    from supervisor.cli import main
    from supervisor.workers.launch import group_share

    hosts = tmp_path / "hosts.json"
    hosts.write_text(_json.dumps({"hosts": [{"ssh": "127.0.0.1", "ips": ["10.0.0.1"]},
                                            {"ssh": "mac2", "ips": ["10.0.0.2"]},
                                            {"ssh": "mac3", "ips": ["10.0.0.3"]}]}))
    assert local_share(read_hostfile(hosts)) == (1, 3)
    config = Config(models=("big",), hosts=hosts)
    assert group_share(config, "big") == (1, 3)
    assert group_share(config, "other") == (1, 1)  # loaded on request: one process
    hosts.write_text(_json.dumps([{"ssh": "mac2"}, {"ssh": "mac3"}]))
    with pytest.raises(ValueError, match="first host must be this machine"):
        read_hostfile(hosts)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "big", "--hosts", str(hosts), "--state-dir", str(tmp_path / "s"),
              "--log-dir", str(tmp_path / "logs")])
    assert exit_.value.code == 2
    assert "--hosts: the hostfile" in capsys.readouterr().err


def test_judge(tmp_path):
    g = gate(tmp_path)
    free = MemoryReading(10 * GiB, 16 * GiB, NORMAL)
    assert g.judge(4 * GiB, free).fits
    v = g.judge(4 * GiB, free, reserved=7 * GiB)  # another load is on its way
    assert not v.fits and v.free_bytes == 3 * GiB and "not enough" in v.reason
    v = g.judge(1 * GiB, MemoryReading(10 * GiB, 16 * GiB, CRITICAL))
    assert not v.fits and "critical" in v.reason
    assert g.judge(1 * GiB, MemoryReading(10 * GiB, 16 * GiB, WARN)).fits
    budget = gate(tmp_path, memory_budget=8 * GiB)
    v = budget.judge(4 * GiB, free, committed=5 * GiB)
    assert not v.fits and v.free_bytes == 3 * GiB and "budget" in v.reason
    assert budget.judge(3 * GiB, free, committed=5 * GiB).fits


@pytest.mark.parametrize("text,n", [("512", 512), ("1k", 1024), ("2M", 2 << 20), ("1.5G", 3 << 29),
                                    ("8GiB", 8 << 30), ("1 tb", 1 << 40)])
def test_size(text, n):
    assert size(text) == n


@pytest.mark.parametrize("bad", ["", "G", "12X", "-", "1.2.3G"])
def test_size_rejects(bad):
    with pytest.raises(ValueError):
        size(bad)


def test_token_rate_window():
    rate = TokenRate(window_s=60)
    for t in range(0, 30):       # 10 tokens/s for 30 s
        rate.add(10, 1000.0 + t)
    assert rate.per_second(1029.5) == pytest.approx(300 / 60)
    assert rate.per_second(1029.5, since=1000.0) == pytest.approx(300 / 29.5)
    assert rate.per_second(1089.5) == pytest.approx(10 / 60)  # only second 1029 is left
    assert rate.per_second(2000.0) == 0.0


def test_liveness_verdicts():
    cfg = Config(heartbeat_timeout=2, hang_timeout=5, cancel_grace=1)
    lv = Liveness(heartbeat_at=100.0, steps_changed_at=100.0)
    assert lv.verdict(101.0, cfg, busy=True, cancels=[]) is None
    assert lv.verdict(102.5, cfg, busy=False, cancels=[]).cause is ExitCause.HEARTBEAT
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=0), 104.0)
    assert lv.verdict(104.0, cfg, busy=False, cancels=[]) is None  # idle: not hung
    assert lv.verdict(105.5, cfg, busy=True, cancels=[]).cause is ExitCause.HUNG
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=7), 105.5)
    assert lv.steps_changed_at == 105.5
    verdict = lv.verdict(105.5, cfg, busy=True, cancels=[(None, 0), (104.0, 0)])
    assert verdict.cause is ExitCause.CANCEL and "1 s" in verdict.reason
    assert lv.verdict(105.5, cfg, busy=True, cancels=[(105.0, 0)]) is None  # in its grace


def test_a_cancel_is_unanswered_only_once_steps_went_by_without_it():
    """The worker drops a cancelled sequence at its next step boundary. A cancel that
    meets one long step (a prefill chunk on a loaded machine) is not ignored: the worker
    was killed for it under load; the hang check bounds a step that never ends. Steps
    that go by past the grace without the cancel answered condemn the worker."""
    cfg = Config(heartbeat_timeout=1000, hang_timeout=1000, cancel_grace=5)
    lv = Liveness(heartbeat_at=100.0, steps_changed_at=100.0)
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=10), 100.0)
    cancel = [(100.0, 10)]  # sent at 100, the worker at step 10 as last heard
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=11), 130.0)  # one long step
    assert lv.verdict(130.0, cfg, busy=True, cancels=cancel) is None
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=12), 131.0)
    assert lv.verdict(131.0, cfg, busy=True, cancels=cancel) is None
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=13), 132.0)  # past a boundary
    assert lv.verdict(132.0, cfg, busy=True, cancels=cancel).cause is ExitCause.CANCEL
    assert lv.verdict(104.0, cfg, busy=True, cancels=cancel) is None  # within the grace


def test_an_idle_worker_is_judged_by_its_mlx_memory_in_use_plus_its_buffer_cache():
    """MLX's buffer cache is memory the process holds all the same: a worker whose active
    memory alone is within its limit, but not with its cache, is recycled; a busy one
    never is."""
    cfg = Config(heartbeat_timeout=1000, hang_timeout=1000)
    lv = Liveness(heartbeat_at=100.0, steps_changed_at=100.0)
    lv.on_heartbeat(Heartbeat(epoch=1, state="ready", active_bytes=600, cache_bytes=300), 100.0)
    assert lv.held_bytes == 900
    assert lv.verdict(100.0, cfg, busy=False, cancels=[], memory_limit=1000) is None
    lv.on_heartbeat(Heartbeat(epoch=1, state="ready", active_bytes=600, cache_bytes=500), 101.0)
    verdict = lv.verdict(101.0, cfg, busy=False, cancels=[], memory_limit=1000)
    assert verdict.cause is ExitCause.MEMORY and "buffer cache" in verdict.reason
    assert lv.verdict(101.0, cfg, busy=True, cancels=[], memory_limit=1000) is None
    # An older worker's heartbeat has no cache figure: it decodes, its cache as 0.
    import msgpack
    from protocol import decode_up

    wire = msgpack.packb({"type": "heartbeat", "epoch": 1, "state": "ready",
                          "active_bytes": 600})
    assert decode_up(wire).cache_bytes == 0


def test_the_hang_clock_starts_when_an_idle_worker_is_given_work():
    cfg = Config(heartbeat_timeout=1000, hang_timeout=5)
    lv = Liveness(heartbeat_at=100.0, steps_changed_at=100.0)  # last step at 100, then idle
    assert lv.verdict(299.0, cfg, busy=False, cancels=[]) is None  # idle: never hung
    assert lv.verdict(300.0, cfg, busy=True, cancels=[], busy_since=299.0) is None
    assert lv.verdict(304.0, cfg, busy=True, cancels=[], busy_since=299.0) is None
    assert lv.verdict(304.5, cfg, busy=True, cancels=[],
                      busy_since=299.0).cause is ExitCause.HUNG
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", steps=1), 304.0)  # it stepped: progress
    assert lv.verdict(308.0, cfg, busy=True, cancels=[], busy_since=299.0) is None


def test_a_silent_rank_of_a_worker_group_condemns_the_group_even_when_idle():
    """The leader's own heartbeats flow; one of its ranks has been quiet too long."""
    cfg = Config(heartbeat_timeout=2, hang_timeout=5)
    lv = Liveness(heartbeat_at=100.0, steps_changed_at=100.0)
    lv.on_heartbeat(Heartbeat(epoch=1, state="ready", group_silence=1.5), 100.0)
    assert lv.verdict(100.0, cfg, busy=False, cancels=[]) is None
    lv.on_heartbeat(Heartbeat(epoch=1, state="ready", group_silence=2.5), 101.0)
    verdict = lv.verdict(101.0, cfg, busy=False, cancels=[])
    assert verdict.cause is ExitCause.HEARTBEAT and "rank of the worker group" in verdict.reason


def test_a_groups_ranks_show_their_memory_as_the_last_heartbeat_said():
    from supervisor.workers.report import live_group as _live_group

    lv = Liveness()
    lv.on_heartbeat(Heartbeat(epoch=1, state="busy", active_bytes=10, peak_bytes=11,
                              group_memory=[(1, 20, 21)]), 1.0)
    ready = {"size": 3, "ranks": [{"rank": r, "host": "h", "pid": r, "active_bytes": 1,
                                   "peak_bytes": 2} for r in range(3)]}
    ranks = _live_group(ready, lv)["ranks"]
    assert [(r["active_bytes"], r["peak_bytes"]) for r in ranks] == [(10, 11), (20, 21), (1, 2)]
    assert ready["ranks"][0]["active_bytes"] == 1   # Ready's figures are kept as they were
    assert _live_group(None, lv) is None


def test_liveness_keeps_what_heartbeats_say_of_the_cache_and_the_load():
    from protocol.messages import CacheStats

    lv = Liveness()
    lv.on_heartbeat(Heartbeat(epoch=1, state="loading", load_progress=0.5), 1.0)
    assert (lv.load_progress, lv.prompt_cache) == (0.5, None)
    stats = CacheStats(hits=3, misses=1, tokens_reused=900, bytes=1 << 20, entries=2)
    lv.on_heartbeat(Heartbeat(epoch=1, state="ready", prompt_cache=stats), 2.0)
    assert (lv.load_progress, lv.prompt_cache) == (None, stats)


# ---- the GPU's own memory on MLX's CUDA backend ------------------------------------------

def _cuda(total: int, free: int, key: str = "total_memory") -> str:
    return json.dumps({"cuda": True, "info": {"device_name": "NVIDIA H100", key: total,
                                               "free_memory": free}})


def test_device_info_is_read_by_the_names_mlx_gives_it():
    from supervisor.memory.probe import parse_device_info

    assert parse_device_info(_cuda(80 << 30, 70 << 30)) == (True, 80 << 30, 70 << 30)
    assert parse_device_info(_cuda(80 << 30, 1, key="memory_size")) == (True, 80 << 30, 1)
    assert parse_device_info('{"cuda": false, "info": {}}\n') == (False, 0, 0)
    assert parse_device_info("") is None and parse_device_info("garbage") is None
    assert parse_device_info('{"cuda": true, "info": {}}') is None  # no size: unreadable


def test_on_cuda_the_gate_reads_the_gpu_with_the_hosts_pressure():
    from supervisor.memory.probe import DeviceProbe

    host = lambda: MemoryReading(120 << 30, 126 << 30, "warn", "psutil")  # noqa: E731
    runs, now = [], [0.0]
    readings = iter([_cuda(80 << 30, 60 << 30), _cuda(80 << 30, 10 << 30), "", ""])
    probe = DeviceProbe(host, run=lambda: runs.append(1) or next(readings), ttl=2.0,
                        clock=lambda: now[0])
    r = probe()
    assert (r.total_bytes, r.available_bytes, r.pressure, r.source) == (
        80 << 30, 60 << 30, "warn", "mlx-cuda")
    now[0] = 1.0
    assert probe().available_bytes == 60 << 30 and len(runs) == 1  # cached within ttl
    now[0] = 3.0
    assert probe().available_bytes == 10 << 30 and len(runs) == 2
    now[0] = 6.0
    assert probe().available_bytes == 10 << 30  # an unreadable moment: the last reading


def test_elsewhere_the_gate_reads_the_host_and_asks_once():
    from supervisor.memory.probe import DeviceProbe

    host = MemoryReading(20 << 30, 24 << 30, "normal", "psutil")
    runs = []
    probe = DeviceProbe(lambda: host, run=lambda: runs.append(1) or '{"cuda": false}')
    assert probe() == host and probe() == host and len(runs) == 1 and probe.cuda is False
    broken = DeviceProbe(lambda: host, run=lambda: "")  # MLX could not even be asked
    assert broken() == host and broken.cuda is False
