"""Warm-up: the bucket grid, the parallel compile, the report and the persistent cache."""

import itertools
import os

import jax
import pytest
from _engine_helpers import make_llm, random_prompts
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache
from test_engine import dense_greedy

import jpaged
from jpaged.engine import compile_cache, runner
from jpaged.engine.buckets import BucketGrid, stop_bucket

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "seqs, tokens, rows, toks",
    [
        (256, 2048, (16, 64, 128, 256), (64, 128, 256, 512, 1024, 2048)),
        (128, 2048, (16, 64, 128), (64, 128, 256, 512, 1024, 2048)),
        (8, 32, (8,), (32,)),
        (24, 100, (16, 24), (64, 100)),
        (300, 256, (16, 64, 128, 256, 300), (64, 128, 256, 300)),  # rows past the budget
        (1, 1, (1,), (1,)),
    ],
)
def test_bucket_grid(seqs, tokens, rows, toks):
    grid = BucketGrid(seqs, tokens)
    assert grid.row_buckets == rows and grid.token_buckets == toks
    ragged = {(k.rows, k.tokens) for k in grid.programs(loops=True, modes=("greedy",))
              if k.kind == "ragged"}  # fmt: skip
    assert len(ragged) == len(toks)
    # Every step the scheduler can plan (at most `tokens` tokens, `seqs` rows) lands on a
    # warmed shape that holds it: counts at and around every bucket's edge.
    edges = {1, 2, tokens, seqs} | {b + d for b in rows + toks for d in (-1, 0, 1)}
    for n, r in itertools.product(sorted(edges), repeat=2):
        if not (1 <= n <= tokens and 1 <= r <= seqs):
            continue
        B, T = grid.ragged_shape(num_tokens=n, num_rows=r)
        assert (B, T) in ragged and r <= B and n <= T
        assert grid.rows(r) in rows and grid.rows(r) >= r


def test_program_list_follows_the_configuration():
    grid = BucketGrid(256, 2048)
    modes = runner.SAMPLING_MODES
    with_loops = grid.programs(loops=True, modes=modes)
    assert len(with_loops) == 4 + 4 * 3 + 6
    joining = grid.programs(loops=True, modes=modes, join=True)
    # A join per (carry, step) pair of row buckets, a grow per larger row bucket.
    assert joining[: len(with_loops)] == with_loops
    assert [k.kind for k in joining[len(with_loops) :]] == ["join"] * 16 + ["grow"] * 6
    single = grid.programs(loops=False, modes=modes)
    assert [k.kind for k in single] == ["decode"] * 4 + ["ragged"] * 6
    assert grid.programs(loops=False, modes=modes, join=True) == single
    assert [stop_bucket(n) for n in (0, 1, 8, 9, 17)] == [8, 8, 8, 16, 32]
    with pytest.raises(ValueError, match="max_num_seqs=0 must be an int >= 1"):
        BucketGrid(0, 16)


def test_warmup_report_and_no_compiles_after_it(capsys):
    llm = make_llm(max_num_seqs=5)  # the default decode (chains); a row bucket no other test uses
    report = llm.warmup(threads=2, progress=True)
    bar = capsys.readouterr().err  # tqdm's bar over the step programs
    assert "jpaged warm-up: 6 programs" in bar and "6/6" in bar, bar[-500:]
    assert "0 loaded, 0 from the cache" in bar, bar[-500:]
    assert report.threads == 2 and report.cache_dir is None
    assert [p.name for p in report.programs] == [
        "decode B=5", "loop B=5 greedy", "loop B=5 random", "loop B=5 truncate",
        "ragged T=32 B=5", "join B=5 R=5",  # rows joining a running chain
    ]  # fmt: skip
    assert all(p.lower_s > 0 and p.compile_s > 0 and p.run_s > 0 for p in report.programs)
    assert report.total_s >= sum(p.lower_s for p in report.programs)
    text = str(report)
    assert "warm-up: 9 programs (6 step programs, 3 page programs)" in text
    assert "loop B=5 truncate" in text and "no persistent cache" in text
    warm = llm.stats()["recompiles"]
    prompts = random_prompts(30, (3, 17, 9, 1, 30))
    outs = llm.generate(prompts, jpaged.SamplingParams(max_tokens=7, **GREEDY))
    assert llm.stats()["recompiles"] == warm
    assert llm.stats()["loop_decode_steps"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 7) for p in prompts]


def test_no_compiles_after_warmup_through_swaps_joins_and_a_replaced_pool(backend_compiles):
    # A pool too small for the batch: sequences are swapped out and back in (the swap-in
    # writes host blocks into the pool), rows join running chains (their carries placed on
    # the device), and the test's NaN pool replaced the engine's before warm-up.
    llm = make_llm(num_decode_steps=4, max_num_seqs=7, num_pages=14, watermark=0.0,
                   preemption_mode="swap", enable_prefix_caching=False)  # fmt: skip
    llm.warmup(threads=2)
    before = backend_compiles()
    prompts = random_prompts(32, (20, 3, 17, 9, 1, 30, 12))
    params = jpaged.SamplingParams(max_tokens=24, **GREEDY)
    ids = [llm.add_request(p, params) for p in prompts[:3]]
    for _ in range(2):  # a chain runs when the others arrive
        llm.step()
    ids += [llm.add_request(p, params) for p in prompts[3:]]
    while llm.has_unfinished_requests():
        llm.step()
    outs = [llm.get_output(i) for i in ids]
    s = llm.stats()
    assert s["preemptions_swap"] >= 1 and s["swapped_in_bytes"] > 0 and s["chain_joins"] > 0
    assert backend_compiles() == before
    assert [o.outputs[0].token_ids for o in outs] == [dense_greedy(p, 24) for p in prompts]


@pytest.fixture
def jax_cache_state():
    """Restores JAX's cache settings (process-wide) and jpaged's record of them."""
    saved = (jax.config.jax_compilation_cache_dir,
             jax.config.jax_persistent_cache_min_compile_time_secs,
             compile_cache._SET_BY_JPAGED[0])  # fmt: skip
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax_compilation_cache.reset_cache()
    compile_cache._SET_BY_JPAGED[0] = saved[2]


def test_the_persistent_cache_serves_a_second_warmup(tmp_path, jax_cache_state):
    # CPU compiles take well under JAX's default 1 s threshold for writing an entry.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    # Programs compiled by earlier tests in this process would come from memory, unwritten.
    jax.clear_caches()
    runner._programs.cache_clear()
    kw = dict(chain_decode=False, max_num_seqs=3, compilation_cache=tmp_path / "c")
    llm = make_llm(**kw)
    assert llm.compilation_cache_dir == str(tmp_path / "c")
    cold = llm.warmup()
    assert cold.cache_dir == str(tmp_path / "c") and cold.cache_hits == 0
    assert [p.name for p in cold.programs] == ["decode B=3", "ragged T=32 B=3"]
    assert len(os.listdir(tmp_path / "c")) >= 2
    prompts = random_prompts(31, (4, 12))
    params = jpaged.SamplingParams(max_tokens=5, **GREEDY)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # A fresh start within this process: the in-memory caches dropped, the disk kept.
    jax.clear_caches()
    runner._programs.cache_clear()
    llm = make_llm(**kw)
    warm = llm.warmup()
    assert warm.cache_hits == 2 and all(p.cache_hit for p in warm.programs)
    traced = llm.stats()["recompiles"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first
    # Single steps: the decode step and the ragged step were all it needed.
    assert llm.stats()["recompiles"] == traced and llm.stats()["loop_decode_steps"] == 0


def test_cache_directory_rules(tmp_path, monkeypatch, jax_cache_state):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compile_cache.ENV_VAR)
    default = compile_cache.default_cache_dir()
    assert default.parent == tmp_path / "xdg" / "jpaged"
    assert default.name.startswith(f"jax-{jax.__version__}-jaxlib-") and "-jpaged-" in default.name
    assert default.name.endswith(f"-{jax.devices()[0].platform}-cpu")
    assert compile_cache.configure(True) == str(default) and default.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(default)
    assert compile_cache.configure(tmp_path / "mine") == str(tmp_path / "mine")
    assert compile_cache.configure(None) is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "env"))
    assert compile_cache.configure(True) == str(tmp_path / "env")
    monkeypatch.setenv(compile_cache.ENV_VAR, "off")
    assert compile_cache.configure(True) is None
    # A directory the user gave JAX is kept, whatever the engine is asked.
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    assert compile_cache.configure(True) == str(tmp_path / "user")
    assert compile_cache.configure(None) == str(tmp_path / "user")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "user")
    with pytest.raises(ValueError, match="compilation_cache=3 must be True"):
        compile_cache.configure(3)
    with pytest.raises(ValueError, match="compilation_cache=3 must be True"):
        make_llm(compilation_cache=3)
