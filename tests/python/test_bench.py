"""The benchmark CLI (python -m flash_dmattn.bench) without a GPU: suite definitions, FLOP counts
against hand counts, the check's rule, the table, the JSON merge, and the "nothing can run"
path. These need numpy only (CI runs them without torch); the tests at the end run the harness
on CPU tensors and need torch, like test_torch_cpu.py, and skip without it.
"""
import json
import os
import sys
import types

import numpy as np
import pytest

from flash_dmattn.bench import __main__ as cli
from flash_dmattn.bench import check, flops, report, suites

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------------
# Suites


def test_suite_counts_and_shapes():
    seed = suites.cases("seed")
    assert [(c.window, c.block) for c in seed] == \
        [(w, 0) for w in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)] + [(1024, 64)]
    assert [c.sweep != "" for c in seed] == [True] * 10 + [False]  # the smoothed case is not a sweep point
    assert {(c.batch, c.heads, c.kv_heads, c.seqlen_q, c.seqlen_k, c.head_dim, c.causal, c.mask) for c in seed} == \
        {(1, 2, 1, 16384, 16384, 32, True, "topk")}
    assert all(c.modes == ("fwd", "bwd", "fwd_bwd") for c in seed)

    training = suites.cases("training")
    assert len(training) == 6
    assert {(c.batch, c.heads, c.kv_heads, c.seqlen_q, c.causal, c.bias) for c in training} == \
        {(2, 16, 4, 8192, True, True)}
    assert sorted((c.head_dim, c.mask, c.window) for c in training) == [
        (64, "all_true", 0), (64, "topk", 2048), (64, "window", 1024),
        (128, "all_true", 0), (128, "topk", 2048), (128, "window", 1024)]

    decode = suites.cases("decode")
    assert sorted((c.mask, c.seqlen_k) for c in decode) == [
        ("none", 8192), ("none", 32768), ("none", 131072), ("topk", 8192), ("topk", 32768), ("topk", 131072)]
    assert all((c.heads, c.kv_heads, c.seqlen_q, c.head_dim, c.modes) == (32, 8, 1, 128, ("fwd",)) for c in decode)

    readme = suites.cases("upstream-readme")
    by_sweep = {}
    for c in readme:
        by_sweep.setdefault(c.sweep, []).append(c)
    assert [c.x for c in by_sweep["Q=K, W1024"]] == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert [c.x for c in by_sweep["window, Q=K=32768"]] == [2 ** e for e in range(5, 16)]
    assert [c.x for c in by_sweep["decode K, Q1 W1024"]] == [2 ** e for e in range(8, 20)]
    assert all((c.batch, c.heads, c.kv_heads, c.head_dim) == (1, 2, 1, 64) for c in readme)


def test_quick_and_max_cases_shrink_the_suites():
    for name in suites.SUITES:
        full, quick = suites.cases(name), suites.cases(name, quick=True)
        assert 0 < len(quick) <= len(full)
        assert max(c.seqlen_q * c.seqlen_k for c in quick) <= max(c.seqlen_q * c.seqlen_k for c in full)
    assert len(suites.cases("seed", max_cases=2)) == 2
    assert [c.seqlen_q for c in suites.cases("training", quick=True)] == [2048] * 6


def test_case_names_keys_and_validation():
    case = suites.cases("training")[2]
    assert case.name == "B2 H16/4 Q8192 K8192 D128 C top2048"
    readme = suites.cases("upstream-readme")
    # W1024 at 32768 is a point of two sweeps: the same key, so it runs once.
    twins = [c for c in readme if c.seqlen_q == 32768 and c.window == 1024]
    assert len(twins) == 2 and twins[0].key == twins[1].key and twins[0].sweep != twins[1].sweep
    with pytest.raises(ValueError, match="needs a window"):
        suites.Case("x", 1, 1, 1, 8, 8, 8, True, "topk")
    with pytest.raises(ValueError, match="does not divide"):
        suites.Case("x", 1, 4, 3, 8, 8, 8, True, "none")
    with pytest.raises(ValueError, match="unknown suite"):
        suites.cases("nope")


def test_block_smoothing_is_for_top_k_masks():
    with pytest.raises(ValueError, match="block smoothing applies to top-k masks"):
        suites.Case("x", 1, 2, 1, 64, 64, 32, True, "window", 16, block=8)


def test_list_runs_without_torch(capsys):
    assert cli.main(["--list", "--suite", "seed"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("seed: 11 cases") and "B1 H2/1 Q16384 K16384 D32 C top16384" in out
    assert "B1 H2/1 Q16384 K16384 D32 C top1024 block64" in out


# ------------------------------------------------------------------------------------------------
# FLOP counts


def test_kernel_tiles_follow_tile_size_h():
    assert flops.kernel_tiles(32) == {"fwd": (64, 128), "bwd": (64, 128)}
    assert flops.kernel_tiles(64) == {"fwd": (64, 128), "bwd": (64, 128)}
    assert flops.kernel_tiles(96) == {"fwd": (64, 64), "bwd": (64, 64)}
    assert flops.kernel_tiles(128) == {"fwd": (64, 64), "bwd": (64, 64)}
    assert flops.kernel_tiles(256) == {"fwd": (128, 64), "bwd": (64, 64)}


def test_gather_tiles_count_the_union_of_each_query_tile():
    assert flops.gather_tiles(32) == {"fwd": (64, 1), "bwd": (64, 1)}
    assert flops.gather_tiles(128) == {"fwd": (64, 1), "bwd": (64, 1)}
    assert flops.gather_tiles(256) == {"fwd": (128, 1), "bwd": (64, 64)}
    # Two query tiles of 2 rows over 6 keys: the first tile's rows see keys {0, 3} and {3, 5}
    # (union 3 keys), the second's none and {1} (union 1 key).
    visible = np.zeros((1, 1, 4, 6), dtype=bool)
    visible[0, 0, 0, [0, 3]] = visible[0, 0, 1, [3, 5]] = visible[0, 0, 3, 1] = True
    pairs, density = flops.visited_pairs(visible, (2, 1), batch=1, heads=1)
    assert pairs == 2 * 3 + 2 * 1 and density == pytest.approx(4 / 12)


def test_tile_shapes_match_the_header():
    """kernel_tiles restates src/kernels/sm80/tile_size.h: the shapes must be the header's."""
    header = open(os.path.join(REPO, "src", "kernels", "sm80", "tile_size.h")).read()
    for shape in ("{64, 128, 4, 2}", "{64, 64, 4, 2}", "{128, 64, 8, 1}", "{64, 128, 8, 2, 4, 4, 1, true}",
                  "{64, 64, 8, 4, 2, 4, 1, true}"):
        assert shape in header, f"tile_size.h changed ({shape} is gone): update flops.kernel_tiles"


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, pairs", [
    (4, 4, True, 10),      # 1 + 2 + 3 + 4
    (2, 5, True, 9),       # rows 11110 / 11111 (docs/semantics.md's example)
    (5, 2, True, 3),       # rows 00, 00, 00, 10, 11
    (1, 7, True, 7),       # decode: the one row sees every key
    (3, 7, False, 21),
])
def test_causal_pairs_by_hand(seqlen_q, seqlen_k, causal, pairs):
    assert flops.causal_pairs(seqlen_q, seqlen_k, causal) == pairs
    brute = sum(j <= i + seqlen_k - seqlen_q or not causal for i in range(seqlen_q) for j in range(seqlen_k))
    assert brute == pairs


def test_dense_flops_by_hand():
    # B2 H3 D8, 4x4 causal: 10 pairs; 4·D FLOPs per pair forward, 10·D backward.
    assert flops.dense_flops(2, 3, 8, 4, 4, True, "fwd") == 2 * 3 * 4 * 8 * 10
    assert flops.dense_flops(2, 3, 8, 4, 4, True, "bwd") == 2 * 3 * 10 * 8 * 10
    assert flops.dense_flops(2, 3, 8, 4, 4, True, "fwd_bwd") == 2 * 3 * 14 * 8 * 10
    assert flops.dense_flops(1, 1, 128, 8192, 8192, True, "fwd") == pytest.approx(4 * 128 * 8192 ** 2 / 2, rel=1e-3)


def tiny_visibility():
    """(1, 2, 5, 7): mask head 0 sees (0, 0), (3, 4) and (4, 6); mask head 1 sees nothing."""
    visible = np.zeros((1, 2, 5, 7), dtype=bool)
    visible[0, 0, 0, 0] = visible[0, 0, 3, 4] = visible[0, 0, 4, 6] = True
    return visible


def test_visited_pairs_by_hand():
    # 2x3 tiles over 5x7: a 3x3 grid. Visited: tile (0,0) = rows 0-1 x keys 0-2 (6 pairs), tile (1,1)
    # = rows 2-3 x keys 3-5 (6), tile (2,2) = row 4 x key 6 (1: clipped at the problem's ends).
    tiles = flops.tile_map(tiny_visibility(), 2, 3)
    assert tiles.shape == (1, 2, 3, 3)
    assert tiles[0, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert not tiles[0, 1].any()
    # B2 H4 over one batch map and two mask heads: each map stands for 2 batches x 2 query heads.
    pairs, density = flops.visited_pairs(tiny_visibility(), (2, 3), batch=2, heads=4)
    assert pairs == (6 + 6 + 1) * 2 * 2
    assert density == pytest.approx(3 / 18)
    assert flops.pass_flops(16, pairs, pairs, "fwd") == 4 * 16 * pairs
    assert flops.pass_flops(16, pairs, 0, "bwd") == 0


def test_visited_pairs_of_a_full_causal_map_are_the_tiles_it_touches():
    s = 8
    visible = np.tril(np.ones((s, s), dtype=bool))[None, None]
    # 4x4 tiles: the diagonal tiles (2 of them, 16 pairs each) and the one below: 48 pairs.
    assert flops.visited_pairs(visible, (4, 4), 1, 1) == (48, 0.75)
    # 1x1 tiles count exactly the visible pairs.
    assert flops.visited_pairs(visible, (1, 1), 1, 1)[0] == flops.causal_pairs(s, s, True)


def test_visited_pairs_on_torch_tensors():
    torch = pytest.importorskip("torch")
    assert flops.visited_pairs(torch.from_numpy(tiny_visibility()), (2, 3), 2, 4) == \
        flops.visited_pairs(tiny_visibility(), (2, 3), 2, 4)


# ------------------------------------------------------------------------------------------------
# The check's rule


def test_check_passes_within_tolerance_and_fails_beyond():
    expected = np.linspace(-2.0, 2.0, 64).reshape(1, 4, 2, 8)
    near = expected + 0.019 * 2.0  # 1.9 % of max |expected|: within bf16's 2 % for outputs
    far = expected + 0.021 * 2.0
    assert check.compare("x", "case", "out", near, expected, "bfloat16").ok
    failed = check.compare("x", "case", "out", far, expected, "bfloat16")
    assert not failed.ok and failed.error == pytest.approx(0.042)
    assert check.compare("x", "case", "k", far, expected, "bfloat16").ok   # gradients: 5 %
    assert not check.compare("x", "case", "k", far, expected, "float16").ok
    # Relative to the magnitude: the same relative error passes at any scale.
    assert check.compare("x", "case", "out", near * 1e-4, expected * 1e-4, "bfloat16").ok


def test_check_excludes_rows_without_a_visible_key():
    expected = np.ones((1, 3, 2, 4))
    actual = expected.copy()
    actual[0, 1, 0] = np.nan          # SDPA's row without a visible key
    keep = np.ones((1, 3, 2), dtype=bool)
    assert not check.compare("sdpa", "case", "out", actual, expected, "bfloat16", keep).ok
    keep[0, 1, 0] = False
    result = check.compare("sdpa", "case", "out", actual, expected, "bfloat16", keep)
    assert result.ok and result.compared == 5 * 4
    # compare_all restricts the row-indexed tensors (out, dq) only.
    results = check.compare_all("sdpa", "case", {"out": actual, "k": expected + 1}, {"out": expected, "k": expected},
                                "bfloat16", keep)
    assert [(c.tensor, c.ok) for c in results] == [("out", True), ("k", False)]
    assert check.verdict(results) == "FAIL dk"


def test_check_report_names_implementation_case_and_tensor():
    expected = np.ones((2, 2))
    bad = check.compare("flex", "B1 H2/1 Q8 K8 D32 C top4", "bias", expected * 2, expected, "bfloat16")
    report_text = check.failure_report(check.failures([bad]))
    assert "CHECK FAILED" in report_text and "flex on 'B1 H2/1 Q8 K8 D32 C top4': dbias differs" in report_text
    assert check.relative_errors([bad]) == {"dbias": 1.0}
    assert check.worst_margins([bad]) == {"flex": pytest.approx(1.0 / 5e-2)}
    with pytest.raises(ValueError, match="shape"):
        check.compare("x", "case", "out", np.ones(3), np.ones(4), "bfloat16")


# ------------------------------------------------------------------------------------------------
# Table, JSON, plot, progress


def row(impl, mode, ms, prep=None, status="ok", **extra):
    base = {"suite": "training", "case": "B2 H16/4 Q8192 K8192 D128 C top2048", "impl": impl, "mode": mode,
            "status": status, "sweep": "", "x": 0, "mask": "topk", "notes": []}
    if ms is not None:
        base.update(ms=ms, prep_ms=prep, total_ms=ms + (prep or 0.0), dense_tflops=200.0, visited_tflops=210.5,
                    tile_density=0.5039, peak_mib=123.0, check="ok")
    return {**base, **extra}


def test_speedups_and_table():
    rows = [row("ours", "fwd", 2.0, gpu_ms=0.8), row("flex", "fwd", 1.5, prep=5.5, notes=["gqa: enable_gqa"]),
            row("sdpa_cudnn", "fwd", None, status="skipped (no cuDNN)")]
    report.add_speedups(rows)
    assert [r["vs_ours"] for r in rows] == [1.0, 3.5, None]
    lines = report.format_table(rows).splitlines()
    assert lines[0] == "training: B2 H16/4 Q8192 K8192 D128 C top2048"
    header = lines[1].split()
    assert header[:7] == ["impl", "mode", "ms", "gpu", "ms", "prep", "ms"]
    assert lines[2].split()[:7] == ["ours", "fwd", "2.000", "0.800", "-", "2.000", "1.00x"]
    assert lines[3].split()[:7] == ["flex", "fwd", "1.500", "-", "5.500", "7.000", "3.50x"]
    assert lines[3].endswith("gqa: enable_gqa") and lines[4].endswith("skipped (no cuDNN)")
    # Columns line up: every value ends where its header ends.
    assert lines[2].index("2.000") + 5 == lines[1].index(" ms") + 3


def test_kernel_timelines_print_under_the_table():
    kernels = [{"name": "Memset", "us": 15.7, "gap_us": 0.0}, {"name": "backward_gather_kernel", "us": 2109.8,
                                                                 "gap_us": 1.8}]
    rows = [row("ours", "bwd", 2.2, kernels=kernels, span_us=2127.3, kernel_calls=8), row("flex", "bwd", 6.8)]
    text = report.format_kernels(rows).splitlines()
    assert text[0].startswith("kernels (us")
    assert text[1:] == ["  ours bwd (8 calls): span 2127.3 us = Memset 15.7 | backward_gather_kernel 2109.8 (+1.8)"]
    assert report.format_kernels([row("ours", "fwd", 1.0)]) == ""


def test_proportionality_of_a_window_sweep():
    def point(impl, x, gpu_ms, density):
        return row(impl, "bwd", gpu_ms * 2, gpu_ms=gpu_ms, tile_density=density, suite="windows",
                   case=f"D128 C win{x}", sweep="window, D128 Q=K=8192", x=x)
    rows = [point("ours_tile", 8192, 5.0, 0.5), point("ours_tile", 1024, 1.0, 0.125),
            point("ours_tile", 256, 0.5, 0.03125), point("flex", 1024, 2.0, 0.125)]
    text = report.proportionality(rows).splitlines()
    assert text[0].startswith("time over tile density")
    # 1.0 / (0.125 / 0.5 x 5.0) = 0.8; 0.5 / (0.0625 x 5.0) = 1.6; flex has one point: no line.
    assert text[1:] == ["  windows: window, D128 Q=K=8192, ours_tile bwd: 256 1.60x, 1024 0.80x, 8192 1.00x"]
    assert report.proportionality([row("ours", "fwd", 1.0)]) == ""


def test_json_merge_keeps_other_keys_and_rows():
    existing = {"device": "GPU", "forward": [{"workload": "w", "ms": 1.0}],
                "bench_cli": {"seed": {"rows": [row("ours", "fwd", 3.0), row("flex", "bwd", 9.0)]},
                              "decode": {"rows": [row("ours", "fwd", 0.2)]}}}
    merged = report.merge_results(existing, "seed", [row("ours", "fwd", 2.123456789)], {"date": "today"})
    assert merged["forward"] == existing["forward"] and merged["bench_cli"]["decode"] == existing["bench_cli"]["decode"]
    seed = merged["bench_cli"]["seed"]
    assert seed["date"] == "today"
    assert [(r["impl"], r["mode"], r["ms"]) for r in seed["rows"]] == [("flex", "bwd", 9.0), ("ours", "fwd", 2.1235)]
    assert existing["bench_cli"]["seed"]["rows"][0]["ms"] == 3.0  # the input is not modified


def test_save_json_merges_into_the_existing_results_file(tmp_path):
    # Other keys (the C++ benchmark's) and other suites' rows survive a merge.
    path = tmp_path / "NVIDIA_H100_80GB_HBM3.json"
    existing = {"device": "NVIDIA H100 80GB HBM3", "forward": [{"workload": "w", "ms": 1.0}],
                "bench_cli": {"seed": {"rows": [row("flex", "bwd", 3.0)]}}}
    path.write_text(json.dumps(existing))
    report.save_json(str(path), "NVIDIA H100 80GB HBM3", {"training": [row("ours", "fwd", 2.0)]}, {"date": "d"})
    after = json.load(open(path))
    assert {k: v for k, v in after.items() if k != "bench_cli"} == {k: v for k, v in existing.items() if k != "bench_cli"}
    assert after["bench_cli"]["seed"] == existing["bench_cli"]["seed"]
    assert after["bench_cli"]["training"]["rows"][0]["impl"] == "ours"
    report.save_json(str(tmp_path / "new" / "GPU.json"), "GPU", {"seed": []}, {})
    assert json.load(open(tmp_path / "new" / "GPU.json")) == {"device": "GPU", "bench_cli": {"seed": {"rows": []}}}
    assert report.device_file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"


def test_plot_needs_a_sweep(tmp_path):
    assert "no sweep" in report.plot_speedup([row("ours", "fwd", 1.0)], str(tmp_path / "p.png"))
    pytest.importorskip("matplotlib")
    times = {32: {"ours": 1.0, "flex": 2.0}, 64: {"ours": 1.0, "flex": 3.0}}
    rows = [row(impl, "fwd", ms, sweep="window, Q=K=16384", x=x, suite="seed")
            for x, by_impl in times.items() for impl, ms in by_impl.items()]
    report.add_speedups(rows)
    assert report.plot_speedup(rows, str(tmp_path / "p.png")) is None
    assert report.plot_times(rows, str(tmp_path / "t.png")) is None and (tmp_path / "t.png").stat().st_size > 0
    assert report.times_path("r/GPU_X_speedup.png") == "r/GPU_X_times.png"
    assert report.times_path("plot.svg") == "plot_times.svg"
    assert (tmp_path / "p.png").stat().st_size > 0


def test_replot_from_a_results_file(tmp_path, capsys):
    rows = [row("ours", "fwd", 1.0, sweep="window, Q=K=16384", x=32, suite="seed"),
            row("flex", "fwd", 2.0, sweep="window, Q=K=16384", x=32, suite="seed")]
    report.add_speedups(rows)
    report.save_json(str(tmp_path / "GPU_X.json"), "GPU X", {"seed": rows, "training": [row("ours", "fwd", 1.0)]}, {})
    assert report.load_rows(str(tmp_path / "GPU_X.json"), ["seed"]) == ("GPU X", [report.rounded(r) for r in rows])
    assert cli.main(["--replot", str(tmp_path / "GPU_X.json")]) == 0
    out = capsys.readouterr().out
    expected = tmp_path / "GPU_X_speedup.png"
    assert f"plot: {expected}" in out or "plot skipped (matplotlib is not installed" in out


def test_progress_writes_lines_to_a_log():
    class Log:
        text = ""

        def write(self, s):
            Log.text += s

        def flush(self):
            pass

    progress = report.Progress(2, stream=Log())
    progress.step("seed: case one")
    progress.advance()
    progress.step("seed: case two")
    progress.close()
    assert Log.text == "[1/2] seed: case one\n[2/2] seed: case two\n"


# ------------------------------------------------------------------------------------------------
# Nothing to run: no torch, or no GPU


def test_without_torch_everything_is_skipped(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    assert cli.main(["--suite", "training", "--suite", "seed"]) == 0
    out = capsys.readouterr().out
    assert "every implementation is skipped: torch is not installed" in out
    assert "training: 6 cases skipped" in out and "seed: 11 cases skipped" in out


def test_without_a_gpu_everything_is_skipped(monkeypatch, capsys, tmp_path):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert cli.main(["--suite", "training", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "every implementation is skipped: no CUDA GPU" in out and "nothing was timed" in out
    assert list(tmp_path.iterdir()) == []


def test_bad_modes_are_refused():
    with pytest.raises(SystemExit):
        cli.parse_args(["--modes", "fwd,sideways"])


# ------------------------------------------------------------------------------------------------
# The harness on CPU tensors (needs torch)


def test_cpu_run_of_the_smoke_suite(capsys, tmp_path):
    pytest.importorskip("torch")
    argv = ["--suite", "smoke", "--device", "cpu", "--impl", "ours", "--impl", "sdpa_efficient", "--impl", "sdpa_flash",
            "--check", "--max-cases", "3", "--modes", "fwd,bwd", "--warmup", "1", "--min-reps", "1", "--max-reps", "1",
            "--no-progress",
            "--json", str(tmp_path / "cpu.json")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "all within tolerance" in out
    rows = json.load(open(tmp_path / "cpu.json"))["bench_cli"]["smoke"]["rows"]
    assert len(rows) == 3 * 3 * 2
    assert {r["status"] for r in rows} == {"ok"} and {r["check"] for r in rows} == {"ok"}
    efficient = [r for r in rows if r["impl"] == "sdpa_efficient"]
    assert all((r["prep_ms"] is not None) == (r["mode"] != "bwd") and "dbias" in r["check_errors"] for r in efficient)
    assert all(r["total_ms"] == pytest.approx(r["ms"] + (r["prep_ms"] or 0), abs=2e-4) for r in rows)


def test_case_filter_keeps_the_named_cases(capsys, tmp_path):
    pytest.importorskip("torch")
    names = [c.name for c in suites.cases("smoke")]
    argv = ["--suite", "smoke", "--device", "cpu", "--impl", "ours", "--case", names[1], "--modes", "fwd",
            "--warmup", "1", "--min-reps", "1", "--max-reps", "1", "--no-progress", "--json", str(tmp_path / "c.json")]
    assert cli.main(argv) == 0
    rows = json.load(open(tmp_path / "c.json"))["bench_cli"]["smoke"]["rows"]
    assert {r["case"] for r in rows} == {names[1]}


def test_masks_of_each_kind():
    torch = pytest.importorskip("torch")
    from flash_dmattn.bench.problem import make_problem, visibility
    window = make_problem(suites.Case("t", 2, 4, 2, 8, 8, 16, True, "window", 3), torch.bfloat16, torch.device("cpu"))
    assert window.mask.shape == (2, 2, 8, 8)
    assert window.mask[0, 0].sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3]
    topk = make_problem(suites.Case("t", 1, 2, 1, 6, 10, 16, True, "topk", 5), torch.bfloat16, torch.device("cpu"))
    # Row i sees keys j <= i + 4 (bottom-right): the top 5 of them, all of them in the first row.
    assert topk.mask[0, 0].sum(-1).tolist() == [5] * 6
    assert not (topk.mask[0, 0] & ~torch.ones(6, 10, dtype=torch.bool).tril(4)).any()
    # Fewer queries than keys under causality: every row sees a key.
    assert visibility(topk, [(2, 4)]).rows.all()


def test_fold_mask_is_bias_where_visible():
    torch = pytest.importorskip("torch")
    from flash_dmattn.bench.impls import fold_mask
    from flash_dmattn.bench.problem import make_problem
    problem = make_problem(suites.Case("t", 1, 4, 2, 5, 5, 8, True, "topk", 2), torch.bfloat16, torch.device("cpu"))
    folded = fold_mask(problem)
    assert folded.shape == (1, 4, 5, 5)
    for h in range(4):  # query head h reads KV head h // 2
        keep = problem.mask[0, h // 2] & torch.ones(5, 5, dtype=torch.bool).tril()
        assert torch.equal(folded[0, h][keep], problem.bias[0, h // 2, 0].expand(5, 5)[keep])
        assert torch.isinf(folded[0, h][~keep]).all()


def test_rotation_and_median_timing(monkeypatch):
    pytest.importorskip("torch")
    from flash_dmattn.bench import timing
    monkeypatch.setattr(timing, "l2_bytes", lambda device: 50 * 2**20)
    mib = 2**20
    assert timing.rotation(200 * mib, "cuda") == (1, False)   # twice the L2 or more: cold anyway
    assert timing.rotation(30 * mib, "cuda") == (4, False)    # 4 copies hold 120 MiB: enough
    assert timing.rotation(1 * mib, "cuda") == (8, True)      # 8 copies still fit: flush as well
    calls = []
    clock = timing.Clock(__import__("torch").device("cpu"))
    settings = timing.Settings(warmup=2, min_reps=3, max_reps=4, budget_ms=1e9)
    result = timing.measure(clock, lambda i: calls.append(i) or i, lambda state: None, copies=3, flush=False,
                            settings=settings)
    assert result.reps == 4 and result.peak_bytes is None and result.ms >= 0 and result.queued_ms is None
    assert calls == [0, 1, 0, 1, 2, 0]   # warm-up, then the timed calls, rotating over the copies


def test_kernel_names_are_shortened():
    pytest.importorskip("torch")
    from flash_dmattn.bench.timing import short_kernel_name
    assert short_kernel_name("void flash_dmattn::kernels::sm90::backward_gather_kernel<T<1>>(P)") == \
        "backward_gather_kernel"
    assert short_kernel_name("void ns::(anonymous namespace)::reduce_dk_dv_kernel<__nv_bfloat16, 8>(P)") == \
        "reduce_dk_dv_kernel"
    assert short_kernel_name("Memset (Device)") == "Memset"


def test_kernel_timeline_of_calls_between_sleeps():
    pytest.importorskip("torch")
    from flash_dmattn.bench.timing import Event, summarize_calls
    events, t = [], 0.0
    for call in range(4):
        events.append(Event("forward_kernel<>(P)", t, t + 5))   # untimed: a backward's forward, before the sleep
        t += 6
        events.append(Event("spin_kernel", t, t + 100))          # opens the call
        t += 101
        events.append(Event("Memset (Device)", t, t + 2))
        t += 3
        main = 50 + call if call < 3 else 70
        events.append(Event("void ns::main_kernel<1>(P)", t, t + main))
        t += main + 1
        if call == 3:                                            # an extra kernel: a shape of its own, left out
            events.append(Event("extra", t, t + 1))
            t += 2
        events.append(Event("spin_kernel", t, t + 1))            # closes it
        t += 10
    timeline = summarize_calls(list(reversed(events)), is_marker=lambda name: "spin" in name)
    assert timeline.calls == 3 and [k.name for k in timeline.kernels] == ["Memset", "main_kernel"]
    assert [(k.us, k.gap_us) for k in timeline.kernels] == [(2, 0.0), (51, 1)]
    assert timeline.span_us == 54
    # Calls left out by keep (they overtook their sleep) do not count.
    kept = summarize_calls(events, is_marker=lambda name: "spin" in name, keep=[False, True, True, True])
    assert kept.calls == 2 and kept.kernels[1].us == 51.5
    assert summarize_calls([Event("k", 0, 1)], is_marker=lambda name: "spin" in name) is None
    # What runs after a short (closing) sleep is no call's, even where it comes first.
    untimed_first = [Event("spin", 0, 1), Event("B", 2, 3), Event("spin", 4, 104), Event("A", 105, 106),
                     Event("spin", 107, 108)]
    only = summarize_calls(untimed_first, is_marker=lambda name: "spin" in name)
    assert only.calls == 1 and [k.name for k in only.kernels] == ["A"]


def test_kernels_option_prints_and_keeps_each_modes_timeline(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from flash_dmattn.bench import timing
    argv = ["--suite", "smoke", "--device", "cpu", "--impl", "ours", "--max-cases", "1", "--modes", "fwd,bwd",
            "--kernels", "--warmup", "1", "--min-reps", "1", "--max-reps", "1", "--no-progress",
            "--json", str(tmp_path / "k.json")]
    # On the CPU there is no timeline: nothing printed, nothing kept, no note.
    assert cli.main(argv) == 0
    assert "kernels (us" not in capsys.readouterr().out
    rows = json.load(open(tmp_path / "k.json"))["bench_cli"]["smoke"]["rows"]
    assert rows and all("kernels" not in r and not any("timeline" in n for n in r["notes"]) for r in rows)
    # Where the profiler gives one, each mode's row prints and keeps it.
    fake = timing.Timeline([timing.Kernel("main_kernel", 12.5, 0.0), timing.Kernel("combine", 2.0, 1.25)], 15.75, 8)
    monkeypatch.setattr(timing, "kernel_timeline", lambda *args, **kwargs: fake)
    assert cli.main(argv + ["--json", str(tmp_path / "k2.json")]) == 0
    out = capsys.readouterr().out
    assert "  ours fwd (8 calls): span 15.8 us = main_kernel 12.5 | combine 2.0 (+1.2)" in out
    assert "  ours bwd (8 calls): span 15.8 us" in out
    rows = json.load(open(tmp_path / "k2.json"))["bench_cli"]["smoke"]["rows"]
    assert {r["mode"] for r in rows} == {"fwd", "bwd"}
    assert all(r["kernels"][1] == {"name": "combine", "us": 2.0, "gap_us": 1.25} and r["span_us"] == 15.75 and
               r["kernel_calls"] == 8 for r in rows)
    # A profiler failure leaves the timed row, with a note.
    def broken(*args, **kwargs):
        raise RuntimeError("CUPTI unavailable")
    monkeypatch.setattr(timing, "kernel_timeline", broken)
    assert cli.main(argv + ["--json", str(tmp_path / "k3.json")]) == 0
    rows = json.load(open(tmp_path / "k3.json"))["bench_cli"]["smoke"]["rows"]
    assert all(r["status"] == "ok" and any(n.startswith("no kernel timeline") and "CUPTI unavailable" in n
                                            for n in r["notes"]) for r in rows)


def test_queued_timing_retries_overtaken_calls_with_longer_sleeps():
    pytest.importorskip("torch")
    from flash_dmattn.bench import timing

    class FakeClock:
        """Overtaken (None) unless the sleep covers the host time `needed[i]` of call i."""
        def __init__(self, needed):
            self.needed, self.sleeps, self.calls = needed, [], 0

        def flush_l2(self):
            pass

        def time_queued_ms(self, run, host_ms):
            run()
            self.sleeps.append(host_ms)
            needed = self.needed[self.calls]
            if 0.1 + 2 * host_ms >= needed:
                self.calls += 1
                return 1.0 + self.calls
            return None

    prepared = []
    clock = FakeClock([0.1, 5.0, 0.1])   # call 1 needs the sleep grown once (4x)
    median = timing.queued_ms(clock, lambda i: prepared.append(i) or i, lambda state: None, copies=2, flush=True,
                              reps=3, host_ms=1.0)
    assert median == 3.0 and clock.sleeps == [1.0, 1.0, 4.0, 1.0]
    assert prepared == [0, 1, 1, 0]       # an overtaken call is prepared again (a backward's state is spent)
    hopeless = FakeClock([1e9] * 3)
    assert timing.queued_ms(hopeless, lambda i: i, lambda state: None, copies=1, flush=False, reps=3,
                            host_ms=1.0) is None
    assert hopeless.sleeps == [1.0, 4.0, 16.0, 1.0, 4.0, 16.0]  # given up once half the calls cannot count


def test_ours_gather_sets_the_path_around_its_own_calls_only(monkeypatch):
    # Forwards and backwards alike: the harness runs every call and gradient in runner.scope().
    torch = pytest.importorskip("torch")
    import flash_dmattn.interface as interface
    from flash_dmattn.bench.impls import IMPLEMENTATIONS, OursGather
    from flash_dmattn.bench.problem import make_problem
    gather = IMPLEMENTATIONS["ours_gather"]
    assert isinstance(gather, OursGather) and "CUDA" in gather.unavailable(torch.device("cpu"))
    case = suites.Case("t", 1, 2, 1, 8, 8, 16, True, "window", 3)
    assert gather.unsupported(suites.Case("t", 1, 2, 1, 8, 8, 16, True, "none"), torch.device("cpu"))
    assert gather.unsupported(case, torch.device("cpu")) is None
    # What the library would read while ours runs, and after.
    seen = []
    real = interface.flash_dmattn_func
    monkeypatch.setattr(interface, "flash_dmattn_func",
                        lambda *a, **k: seen.append(os.environ.get("FLASH_DMATTN_SPARSE_PATH")) or real(*a, **k))
    monkeypatch.delenv("FLASH_DMATTN_SPARSE_PATH", raising=False)
    runner = gather.runner(make_problem(case, torch.bfloat16, torch.device("cpu")), grad=False)
    assert runner.notes[-1] == "prepared mask" and runner.rebuild is not None
    with runner.scope():
        runner.call(*runner.inputs)
        assert os.environ.get("FLASH_DMATTN_SPARSE_PATH") == "gather"
    assert seen == ["gather"] and "FLASH_DMATTN_SPARSE_PATH" not in os.environ
    # The note names the path the preparation chose (the CPU backend builds no lists).
    assert runner.notes[-1] == "prepared mask, tile path"
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "tile")
    with runner.scope():
        pass
    assert os.environ["FLASH_DMATTN_SPARSE_PATH"] == "tile"


def test_ours_prepared_leaves_the_choice_to_the_preparation(monkeypatch):
    torch = pytest.importorskip("torch")
    from flash_dmattn.bench.impls import IMPLEMENTATIONS, OursPrepared
    from flash_dmattn.bench.problem import make_problem
    prepared = IMPLEMENTATIONS["ours_prepared"]
    assert type(prepared) is OursPrepared and prepared.unavailable(torch.device("cpu")) is None
    case = suites.Case("t", 1, 2, 1, 8, 8, 16, True, "window", 3)
    assert prepared.unsupported(suites.Case("t", 1, 2, 1, 8, 8, 16, True, "none"), torch.device("cpu"))
    monkeypatch.setenv("FLASH_DMATTN_SPARSE_PATH", "tile")
    problem = make_problem(case, torch.bfloat16, torch.device("cpu"))
    runner = prepared.runner(problem, grad=False)
    with runner.scope():
        assert os.environ["FLASH_DMATTN_SPARSE_PATH"] == "auto"
        out = runner.call(*runner.inputs)
    assert os.environ["FLASH_DMATTN_SPARSE_PATH"] == "tile"
    assert runner.notes[-1] == "prepared mask, tile path"
    # Its visited work follows the path the preparation chose (the CPU backend builds no lists).
    from flash_dmattn.bench import flops
    assert runner.tiles == flops.kernel_tiles(16)
    assert set(prepared.tile_candidates(16)) == {*flops.kernel_tiles(16).values(), *flops.gather_tiles(16).values()}
    expected = IMPLEMENTATIONS["ours"].runner(problem, grad=False).call(*runner.inputs)
    assert torch.equal(out, expected)


def test_serving_suite_cases():
    serving = suites.cases("serving")
    packed, equal = serving[0], serving[1]
    assert (packed.batch, sum(packed.lengths), min(packed.lengths), max(packed.lengths)) == (8, 32768, 512, 8192)
    assert (equal.batch * equal.seqlen_q, equal.head_dim, equal.lengths) == (32768, 128, ())
    paged = [c for c in serving if c.page]
    assert len(paged) == 1 and paged[0].batch == 64 and paged[0].page == 64 and paged[0].modes == ("fwd",)
    assert 4096 <= min(paged[0].lengths) and max(paged[0].lengths) <= 32768
    # The real work of a batch of several lengths is the sum over its sequences.
    assert packed.sequence_lengths[0] == (512, 512)
    assert flops.case_dense_flops(packed, "fwd") == sum(
        flops.dense_flops(1, 16, 128, n, n, True, "fwd") for n in packed.lengths)
    with pytest.raises(ValueError, match="lengths"):
        suites.Case("t", 2, 2, 1, 8, 8, 16, True, "all_true", lengths=(8, 9))
    with pytest.raises(ValueError, match="causality or one query row"):
        suites.Case("t", 2, 2, 1, 8, 8, 16, False, "all_true", lengths=(8, 5))
    with pytest.raises(ValueError, match="paged cache is for decode"):
        suites.Case("t", 2, 2, 1, 8, 8, 16, True, "all_true", lengths=(8, 5), page=4)


@pytest.mark.parametrize("name,case", [
    ("ours_varlen", suites.Case("t", 3, 4, 2, 24, 24, 16, True, "all_true", lengths=(24, 7, 13))),
    ("ours_paged", suites.Case("t", 3, 4, 2, 1, 40, 16, False, "all_true", backward=False, lengths=(40, 9, 23),
                               page=8)),
])
def test_packed_and_paged_runners_match_the_padded_batch(name, case):
    """ours_varlen and ours_paged take the padded problem in their own layouts and give back, in
    ours' layout, what ours computes on the padded batch (gradients too where there is a backward)."""
    torch = pytest.importorskip("torch")
    from flash_dmattn.bench.impls import IMPLEMENTATIONS
    from flash_dmattn.bench.problem import make_problem, visibility
    problem = make_problem(case, torch.bfloat16, torch.device("cpu"))
    assert problem.mask.shape == (3, 2, 1, case.seqlen_k)
    assert IMPLEMENTATIONS[name].unsupported(case, torch.device("cpu")) is None
    ours = IMPLEMENTATIONS["ours"].runner(problem, case.backward).results(case.backward)
    other = IMPLEMENTATIONS[name].runner(problem, case.backward).results(case.backward)
    assert set(other) == set(ours)
    rows = visibility(problem, [(16, 16)]).rows  # (B, Sq, H): the padding's query rows see no key
    for key in ours:
        expected, got = ours[key].float(), other[key].float()
        if key == "out":
            expected, got = expected[rows], got[rows]
        assert torch.allclose(got, expected, atol=2e-2, rtol=2e-2), key


def test_packed_mask_runner_matches_ours():
    """ours_packed hands the case's mask over bit-packed: on the CPU backend the same bytes as ours
    with the bool mask, gradients too."""
    torch = pytest.importorskip("torch")
    from flash_dmattn.bench.impls import IMPLEMENTATIONS
    from flash_dmattn.bench.problem import make_problem
    case = suites.Case("t", 2, 4, 2, 20, 21, 16, True, "topk", window=6)
    problem = make_problem(case, torch.bfloat16, torch.device("cpu"))
    packed = IMPLEMENTATIONS["ours_packed"].runner(problem, True)
    assert packed.inputs[list(packed.names).index("mask")].dtype == torch.uint8
    ours = IMPLEMENTATIONS["ours"].runner(problem, True).results(True)
    other = packed.results(True)
    assert set(other) == set(ours)
    for key in ours:
        assert torch.equal(other[key], ours[key]), key
