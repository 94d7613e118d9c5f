"""Hostile input: generated bad rows for the data reader and the reward functions (hypothesis).

Data reader (``rlplug.data.dataset.read_dataset`` with the real SmolLM2 tokenizer): parquet files with
missing, extra or duplicated columns, wrong column types, null values, empty and whitespace
prompts, 100k-character prompts, control characters, invalid UTF-8, chat messages with unknown
roles or non-text content, ground truths that are not strings (ints, floats including NaN/inf,
bools, lists, structs), huge numbers. Every file must end in exactly one of two ways:

* a :class:`~rlplug.data.dataset.DatasetError` whose message names the file (and the row/column when the
  problem is in one), raised before any training; or
* a dataset whose rows all satisfy the row contract, with every dropped (overlong) prompt
  counted in ``num_filtered``.

Any other exception type is a bug. Rewards: the reward manager scores generated responses
against generated rows with every packaged reward function and shaping term; it never raises,
every score is finite, and failures are counted in ``reward/failures``.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rlplug.data.dataset import ALLOWED_ROLES, DatasetError, RLDataset, read_dataset

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ============================================================================ strategies

HOSTILE_TEXT = [
    "",
    " ",
    "\t\n  ",
    "\u200b",
    "\u202eevil",
    "What is 2 + 2?",
    "x" * 100_000,
    "\x00nul",
    "esc\x1b[31m",
    "del\x7f",
    "c1\x85",
    "tab\tand\nnewline\r",
    "\ufeffbom",
    "emoji \U0001f600",
    "9" * 5000,
    "1e999999",
    "-0",
    "NaN",
    "inf",
    "#### 12",
    "<answer>7</answer>",
    "\\boxed{3}",
    '{"answer": 5}',
    "[1, 2]",
    "None",
]
TEXT = st.one_of(st.text(max_size=30), st.sampled_from(HOSTILE_TEXT))
NUMBERS = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.sampled_from([0, -1, 2**63 - 1, -(2**63)]))
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324, 12.0, 1.5]),
)
ROLES = st.sampled_from([*ALLOWED_ROLES, "user", "user", "bogus", "", "USER", "function", None])
SOURCES = st.one_of(st.sampled_from(["basic_arithmetic", "openai/gsm8k", "countdown"]), TEXT)


def _nullable(strategy, p_null: bool = True):
    return st.one_of(st.none(), strategy) if p_null else strategy


# Mostly-valid values, so that whole files pass too (long prompts, unicode, system prompts ...).
PRINTABLE = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=30)
GOOD_TEXT = st.one_of(
    st.sampled_from(
        [
            "What is 2 + 2?",
            "Compute 17 * 3.",
            "word " * 20_000,
            "emoji \U0001f600",
            "\u202e rtl",
            "tab\tand\nnewline",
            "x" * 1000,
        ]
    ),
    PRINTABLE.filter(lambda t: t.strip()),
)


def _weighted(good, bad, validity: int):
    """validity 2: only ``good``; 1: ``good`` 3 times in 4; 0: either with equal chance."""
    return good if validity == 2 else st.one_of(good, good, good, bad) if validity == 1 else st.one_of(good, bad)


def _msg(mostly_valid: int):
    role = _weighted(st.just("user"), ROLES, mostly_valid)
    content = _weighted(GOOD_TEXT, _nullable(TEXT), mostly_valid)
    return st.fixed_dictionaries({"role": role, "content": content})


@st.composite
def columns(draw, n: int) -> tuple[list[str], list[pa.Array]]:
    """Names and arrays of a table of ``n`` rows.

    A third of the tables are valid (only their lengths, unicode and options vary), a third
    have a valid schema with values valid 3 times in 4, and a third pick each column's kind at
    random (missing, wrong type, duplicated ...).
    """
    mostly_valid = draw(st.sampled_from([2, 1, 0]))
    names: list[str] = []
    arrays: list[pa.Array] = []

    def add(name: str, values, type_) -> None:
        names.append(name)
        arrays.append(pa.array(values, type=type_))

    def rows(strategy):
        return draw(st.lists(strategy, min_size=n, max_size=n))

    def kind_of(valid: list[str], hostile: list[str]) -> str:
        return draw(st.sampled_from(valid if mostly_valid else valid + hostile))

    # ---- data_source
    kind = kind_of(["str"], ["null", "int", "dict", "missing"])
    if kind == "str":
        add(
            "data_source",
            rows(_weighted(st.sampled_from(["basic_arithmetic", "openai/gsm8k"]), SOURCES, mostly_valid)),
            pa.string(),
        )
    elif kind == "null":
        add("data_source", rows(_nullable(SOURCES)), pa.string())
    elif kind == "int":
        add("data_source", rows(NUMBERS), pa.int64())
    elif kind == "dict":
        names.append("data_source")
        arrays.append(pa.array(rows(SOURCES), pa.string()).dictionary_encode())

    # ---- prompt
    kind = kind_of(
        ["chat", "plain"],
        [
            "invalid_utf8",
            "list_of_str",
            "int",
            "struct",
            "binary",
            "chat_int_content",
            "chat_extra_field",
            "missing",
            "null_chat",
        ],
    )
    msg_t = pa.struct([("role", pa.string()), ("content", pa.string())])
    chat = st.lists(_msg(mostly_valid), min_size=1 if mostly_valid else 0, max_size=3)
    if mostly_valid == 2:  # a system message first at most, then user/assistant turns
        chat = st.tuples(
            st.lists(st.fixed_dictionaries({"role": st.just("system"), "content": GOOD_TEXT}), max_size=1), chat
        ).map(lambda parts: parts[0] + parts[1])
    if kind == "chat":
        add("prompt", rows(chat), pa.list_(msg_t))
    elif kind == "null_chat":
        add("prompt", rows(_nullable(chat)), pa.large_list(msg_t))
    elif kind == "plain":
        add("prompt", rows(_weighted(GOOD_TEXT, _nullable(TEXT), mostly_valid)), pa.string())
    elif kind == "invalid_utf8":
        raw = rows(st.one_of(st.binary(max_size=12), st.sampled_from([b"\xff\xfe", b"ok \xc3\x28", b"\xed\xa0\x80"])))
        names.append("prompt")
        arrays.append(pa.array(raw, pa.binary()).view(pa.string()))
    elif kind == "list_of_str":
        add("prompt", rows(st.lists(TEXT, max_size=2)), pa.list_(pa.string()))
    elif kind == "int":
        add("prompt", rows(NUMBERS), pa.int64())
    elif kind == "struct":
        add("prompt", rows(_msg(0)), msg_t)
    elif kind == "binary":
        add("prompt", rows(st.binary(max_size=10)), pa.binary())
    elif kind == "chat_int_content":
        add(
            "prompt",
            rows(st.lists(st.fixed_dictionaries({"role": ROLES, "content": NUMBERS}), max_size=2)),
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.int64())])),
        )
    elif kind == "chat_extra_field":
        add(
            "prompt",
            rows(st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT, "name": NUMBERS}), max_size=2)),
            pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.int64())])),
        )

    # ---- reward_model
    kind = kind_of(
        ["str", "int", "float"], ["bool", "list", "struct", "null_gt", "no_gt", "plain_string", "missing", "null_row"]
    )
    gt_types = {
        "str": (_weighted(GOOD_TEXT, TEXT, mostly_valid), pa.string()),
        "int": (NUMBERS, pa.int64()),
        "float": (_weighted(st.floats(allow_nan=False, allow_infinity=False), FLOATS, mostly_valid), pa.float64()),
        "bool": (st.booleans(), pa.bool_()),
        "list": (st.lists(NUMBERS, max_size=2), pa.list_(pa.int64())),
        "struct": (st.fixed_dictionaries({"answer": TEXT}), pa.struct([("answer", pa.string())])),
        "null_gt": (st.none(), pa.string()),
    }
    if kind in gt_types:
        strategy, t = gt_types[kind]
        add(
            "reward_model",
            rows(st.fixed_dictionaries({"style": st.just("rule"), "ground_truth": strategy})),
            pa.struct([("style", pa.string()), ("ground_truth", t)]),
        )
    elif kind == "null_row":
        add(
            "reward_model",
            rows(_nullable(st.fixed_dictionaries({"ground_truth": TEXT}))),
            pa.struct([("ground_truth", pa.string())]),
        )
    elif kind == "no_gt":
        add("reward_model", rows(st.fixed_dictionaries({"style": TEXT})), pa.struct([("style", pa.string())]))
    elif kind == "plain_string":
        add("reward_model", rows(TEXT), pa.string())

    # ---- optional columns
    kind = kind_of(["absent", "str", "null"], ["int"])
    if kind != "absent":
        add(
            "ability",
            rows(_nullable(TEXT) if kind == "str" else NUMBERS if kind == "int" else st.none()),
            {"str": pa.string(), "int": pa.int64(), "null": pa.null()}[kind],
        )
    kind = kind_of(["absent", "struct", "map", "null"], ["str"])
    if kind == "struct":
        add(
            "extra_info",
            rows(_nullable(st.fixed_dictionaries({"split": TEXT, "index": NUMBERS}))),
            pa.struct([("split", pa.string()), ("index", pa.int64())]),
        )
    elif kind == "map":
        add("extra_info", rows(st.lists(st.tuples(TEXT, TEXT), max_size=2)), pa.map_(pa.string(), pa.string()))
    elif kind == "str":
        add("extra_info", rows(TEXT), pa.string())
    elif kind == "null":
        add("extra_info", [None] * n, pa.null())

    # ---- extra columns (in hostile tables possibly duplicating a required name)
    extra_names = (
        st.sampled_from(["junk", "index", "answer"])
        if mostly_valid
        else st.one_of(st.sampled_from(["junk", "prompt", "data_source", "reward_model", "index"]), TEXT)
    )
    for _ in range(draw(st.integers(0, 2))):
        name = draw(extra_names)
        if mostly_valid and name in names:
            continue
        add(name, rows(_nullable(TEXT)), pa.string())
    return names, arrays


def _check_dataset(ds: RLDataset, n_rows: int, max_prompt_length: int | None, filtering: bool) -> None:
    assert isinstance(ds, RLDataset)
    assert len(ds) + ds.num_filtered == n_rows
    if not filtering:
        assert ds.num_filtered == 0
    for i, row in enumerate(ds):
        assert row["index"] == i
        assert isinstance(row["data_source"], str) and row["data_source"].strip()
        assert isinstance(row["ground_truth"], str)
        assert isinstance(row["extra_info"], dict) and isinstance(row["ability"], str)
        assert row["messages"] and all(
            m["role"] in ALLOWED_ROLES and isinstance(m["content"], str) for m in row["messages"]
        )
        assert any(m["content"].strip() for m in row["messages"] if m["role"] != "system")
        ids = row["prompt_ids"]
        assert ids and all(isinstance(t, int) for t in ids)
        if max_prompt_length is not None:
            assert len(ids) <= max_prompt_length


def _check_error(err: DatasetError, path: str, n_rows: int) -> None:
    msg = str(err)
    assert msg.startswith(path), msg
    if ", row " in msg:
        row = int(msg.split(", row ")[1].split(",")[0].split(":")[0])
        assert 0 <= row < n_rows, msg


@pytest.fixture(scope="module")
def tokenizer():
    from rlplug.config.compose import compose
    from rlplug.training.models import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(compose(["debug=tiny", "model.tiny.num_hidden_layers=1"]).model))


@SETTINGS
@given(data=st.data())
def test_hostile_rows_end_in_dataset_error_or_valid_rows(tokenizer, data):
    n = data.draw(st.integers(1, 5), label="rows")
    names, arrays = data.draw(columns(n), label="columns")
    max_len = data.draw(st.sampled_from([None, 1, 16, 64, 4096]), label="max_prompt_length")
    filtering = data.draw(st.booleans(), label="filter_overlong_prompts")
    system_prompt = data.draw(st.one_of(st.none(), TEXT), label="system_prompt")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "hostile.parquet")
        pq.write_table(pa.Table.from_arrays(arrays, names=names), path)
        try:
            ds = read_dataset(
                path,
                tokenizer=tokenizer,
                max_prompt_length=max_len,
                filter_overlong_prompts=filtering,
                system_prompt=system_prompt,
            )
        except DatasetError as err:
            _check_error(err, path, n)
            event("DatasetError: " + str(err).split(": ", 1)[-1][:40])
            return
    _check_dataset(ds, n, max_len, filtering)
    event(f"dataset: {len(ds)} rows, {ds.num_filtered} filtered")


@SETTINGS
@given(blob=st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"PAR1", b"PAR1\x00\x00\x00\x00PAR1"])))
def test_files_that_are_not_parquet_are_dataset_errors(blob):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "not.parquet"
        path.write_bytes(blob)
        with pytest.raises(DatasetError, match="not a readable parquet file"):
            read_dataset(path)


def test_truncated_parquet_and_zero_rows_are_dataset_errors(tmp_path):
    table = pa.table(
        {"data_source": ["a"] * 50, "prompt": ["What is 1+1?"] * 50, "reward_model": [{"ground_truth": "2"}] * 50}
    )
    good = tmp_path / "good.parquet"
    pq.write_table(table, good)
    data = good.read_bytes()
    for cut in (len(data) // 2, len(data) - 3):
        bad = tmp_path / f"cut{cut}.parquet"
        bad.write_bytes(data[:cut])
        with pytest.raises(DatasetError):
            read_dataset(bad)
    empty = tmp_path / "empty.parquet"
    pq.write_table(table.slice(0, 0), empty)
    with pytest.raises(DatasetError, match="no rows"):
        read_dataset(empty)


def test_known_hostile_rows_give_the_expected_messages(tmp_path, tokenizer):
    """A few hand-picked cases, to pin the message for each kind of problem."""
    msg_t = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    rm_t = pa.struct([("ground_truth", pa.string())])

    def read(prompt, gt="1", source="s", prompt_type=msg_t, gt_type=rm_t, **kwargs):
        path = tmp_path / "t.parquet"
        pq.write_table(
            pa.table(
                {
                    "data_source": pa.array([source], pa.string()),
                    "prompt": pa.array([prompt], prompt_type),
                    "reward_model": pa.array([{"ground_truth": gt}], gt_type),
                }
            ),
            path,
        )
        return read_dataset(path, tokenizer=tokenizer, **kwargs)

    cases = [
        ([{"role": "wizard", "content": "hi"}], "message 0 has role 'wizard'; allowed roles"),
        ([{"role": "user", "content": "   \n"}], "is empty or whitespace only"),
        ([], "is an empty list"),
        ([{"role": "user", "content": "a\x00b"}], r"contains control character U\+0000"),
    ]
    for prompt, expected in cases:
        with pytest.raises(DatasetError, match=expected):
            read(prompt)
    with pytest.raises(DatasetError, match="is bool True; expected a string"):
        read([{"role": "user", "content": "q"}], gt=True, gt_type=pa.struct([("ground_truth", pa.bool_())]))
    with pytest.raises(DatasetError, match="is nan; expected a string answer"):
        read([{"role": "user", "content": "q"}], gt=math.nan, gt_type=pa.struct([("ground_truth", pa.float64())]))
    dup = tmp_path / "dup.parquet"  # two 'prompt' columns: pyarrow's schema.field() raised KeyError before
    pq.write_table(
        pa.Table.from_arrays(
            [pa.array(["s"]), pa.array(["q"]), pa.array([{"ground_truth": "1"}], rm_t), pa.array(["other"])],
            names=["data_source", "prompt", "reward_model", "prompt"],
        ),
        dup,
    )
    with pytest.raises(DatasetError, match="column 'prompt': appears 2 times"):
        read_dataset(dup, tokenizer=tokenizer)
    ds = read([{"role": "user", "content": "q"}], gt=12.0, gt_type=pa.struct([("ground_truth", pa.float64())]))
    assert ds[0]["ground_truth"] == "12"
    # a 100k-character prompt: filtered with a count, or a row error when not filtering
    long_prompt = [{"role": "user", "content": "word " * 20_000}]
    path = tmp_path / "two.parquet"
    pq.write_table(
        pa.table(
            {
                "data_source": ["s", "s"],
                "prompt": pa.array([long_prompt, [{"role": "user", "content": "q"}]], msg_t),
                "reward_model": pa.array([{"ground_truth": "1"}] * 2, rm_t),
            }
        ),
        path,
    )
    ds = read_dataset(path, tokenizer=tokenizer, max_prompt_length=256)
    assert len(ds) == 1 and ds.num_filtered == 1
    with pytest.raises(DatasetError, match="row 0, column 'prompt': prompt is .* tokens"):
        read_dataset(path, tokenizer=tokenizer, max_prompt_length=256, filter_overlong_prompts=False)


# ============================================================================ rewards

REWARD_CONFIG = {
    "reward_fn_map": {
        "basic_arithmetic": "gsm8k",
        "openai/gsm8k": "gsm8k",
        "math": "math_verify",
        "countdown": "reasoning_gym",
        "chain_sum": "reasoning_gym",
    },
    "shaping": [{"name": "format", "weight": 0.1}, {"name": "length_penalty", "weight": 0.5}],
    "fallback_score": 0.0,
    "timeout_s": 5.0,
}
HOSTILE_RESPONSES = [
    "#### 99999999999999999999999999999999999999",
    "#### " + "9" * 5000,
    "#### 1e999999",
    "#### -0",
    "#### NaN",
    "<answer>" + "1" * 10_000 + "</answer>",
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{1/0}",
    "<answer>9**9**9</answer>",
    "<answer>(((((((((((1)))))))))))</answer>",
    "#### 1,000,000,000,000,000",
    "x" * 100_000,
    "",
    "\x00\x1b\x7f",
    "<answer>",
    "</answer><answer>",
    "#### $\u221212",
    "#### \U0001f600",
]
GROUND_TRUTHS = st.one_of(
    TEXT,
    NUMBERS,
    FLOATS,
    st.none(),
    st.lists(NUMBERS, max_size=2),
    st.sampled_from(['{"numbers": [1, 2], "target": 3}', '{"numbers": "x"}', "{", "10**100"]),
)
EXTRA_INFO = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(TEXT, st.one_of(TEXT, NUMBERS), max_size=2),
    st.just({"rg_task": "no_such_task"}),
    st.just({"rg_metadata": "{not json"}),
    st.just({"rg_config": "[1, 2]"}),
    st.just("not a dict"),
)


@pytest.fixture(scope="module")
def reward_manager():
    """Worker-process mode: a reward that never returns (C-level big-number arithmetic holds the GIL,
    so no thread-based timeout can stop it) is killed by the manager's backstop instead of
    freezing this test run."""
    from rlplug.rewards.manager import RewardManager

    with RewardManager({**REWARD_CONFIG, "num_workers": 1}, backstop_slack_s=10.0) as manager:
        yield manager


@SETTINGS
@given(data=st.data())
def test_rewards_never_raise_out_of_the_manager(reward_manager, data):
    n = data.draw(st.integers(1, 4), label="n")
    rows = [
        {
            "data_source": data.draw(st.sampled_from(sorted(REWARD_CONFIG["reward_fn_map"]))),
            "ground_truth": data.draw(GROUND_TRUTHS),
            "extra_info": data.draw(EXTRA_INFO),
        }
        for _ in range(n)
    ]
    responses = data.draw(st.lists(st.one_of(TEXT, st.sampled_from(HOSTILE_RESPONSES)), min_size=n, max_size=n))
    before = reward_manager.total_failures
    scores, extra, metrics = reward_manager.score(rows, responses)
    assert len(scores) == n and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert all(len(v) == n for v in extra.values())
    calls = n * (1 + len(REWARD_CONFIG["shaping"]))
    assert 0 <= metrics["reward/timeouts"] <= metrics["reward/failures"] <= calls
    assert reward_manager.total_failures - before == metrics["reward/failures"]
    # each score is correctness (or the fallback 0.0) + 0.1 * format + 0.5 * length shaping
    for i in range(n):
        expected = extra["correctness"][i] + 0.1 * extra["shaping/format"][i] + 0.5 * extra["shaping/length_penalty"][i]
        assert scores[i] == pytest.approx(expected)


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{9^{9^{9}}}",
        "#### 10**10**10",
        "<answer>9^9^9</answer>",
        "\\boxed{9^{99999999}}",
        "\\boxed{9999999!}",
        "the answer is 9**99999999",
        "\\boxed{(9^{999})^{999999}}",
        "\\boxed{(10^{9})!}",
    ],
)
def test_math_verify_does_not_hang_on_number_bombs(response):
    """Serial scoring (the default) cannot interrupt big-number arithmetic in C: math_verify must
    refuse to evaluate such expressions instead of computing them."""
    from rlplug.rewards.manager import RewardManager

    manager = RewardManager({"reward_fn_map": {"math": "math_verify"}, "timeout_s": 30.0})
    start = time.perf_counter()
    scores, extra, metrics = manager.score([{"data_source": "math", "ground_truth": "5"}], [response])
    assert time.perf_counter() - start < 10.0
    assert scores == [0.0] and metrics["reward/failures"] == 0.0


def test_math_verify_screen_keeps_ordinary_answers():
    """The number-bomb screen flags only towers, > 6 exponent digits and huge factorials."""
    from rlplug.plugins.rewards.rules import math_verify, too_costly_to_evaluate

    ordinary = [
        "x^2 + y^2",
        "e^{x^2}",
        "2^{2017}",
        "x^{2}y^{3}",
        "\\frac{x^2}{y^2}",
        "5!",
        "10000!",
        "(x+1)^2",
        "10^{100}",
        "1,000,000",
        "x**2 + 2*x",
        "2^{10}\\cdot 3^{5}",
        "(2^{3})^{4}",
    ]
    assert [t for t in ordinary if too_costly_to_evaluate(t)] == []
    # 2^10 = 1024; 5! = 120; (2^3)^4 = 4096
    for response, truth in (
        ("\\boxed{2^{10}}", "1024"),
        ("\\boxed{5!}", "120"),
        ("<answer>(2^{3})^{4}</answer>", "4096"),
    ):
        assert math_verify("math", response, truth)["score"] == 1.0, response
