import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.support.tiers import examples

from hybridkv.errors import InvalidArgumentError
from hybridkv.planner.sizes import format_bytes, format_tokens, parse_bytes, parse_tokens


@pytest.mark.parametrize(
    "text, expected",
    [
        ("80GiB", 80 * 1024**3),  # 85_899_345_920
        ("80GB", 80 * 1000**3),
        ("512MiB", 512 * 1024**2),
        ("1.5TiB", 3 * 1024**4 // 2),  # 1.5 * 2**40 = 1_649_267_441_664
        ("4096", 4096),
        ("4096B", 4096),
        ("80 GiB", 80 * 1024**3),
        ("80gib", 80 * 1024**3),
        ("24Gi", 24 * 1024**3),
        ("2kB", 2000),
        ("2KiB", 2048),
        ("0.5KiB", 512),
        ("1.0009KiB", 1024),  # 1024.92... rounded down to whole bytes
        (123, 123),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["80XB", "GiB", "", "-1GiB", "1e9", "80 G iB", "1.2.3GB", "0", "0GiB", 0, -5, True,
                                  "999999999999999TiB", "1025TiB", 2**50 + 1, "\uff18\uff10GiB", "nan", "inf GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(InvalidArgumentError) as exc:
        parse_bytes(text)
    assert "\n" not in str(exc.value)


def test_parse_bytes_names_the_bad_unit():
    with pytest.raises(InvalidArgumentError, match=r"unknown memory unit 'XB' in '80XB'"):
        parse_bytes("80XB")


def test_bare_letter_is_ambiguous():
    with pytest.raises(InvalidArgumentError, match=r"ambiguous memory unit 'G'.*GiB.*GB"):
        parse_bytes("80G")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1k", 1000),
        ("1K", 1024),
        ("1m", 1_000_000),
        ("1M", 1_048_576),
        ("1g", 10**9),
        ("1G", 2**30),
        ("1T", 2**40),  # MAX_TOKENS
        ("1t", 10**12),
        ("128k", 128_000),
        ("128K", 131_072),
        ("25.6k", 25_600),
        ("32768", 32768),
        (" 8K ", 8192),
        (4096, 4096),
    ],
)
def test_parse_tokens_vllm_convention(text, expected):
    assert parse_tokens(text) == expected


def test_decimals_need_a_decimal_suffix():
    with pytest.raises(InvalidArgumentError, match=r"did you mean 1.5m\?"):
        parse_tokens("1.5M")


@pytest.mark.parametrize("text", ["1.0005k", "0.5", "1x", "M", "", "-1k", "0", 0, False, "1 MB", "2T", 2**40 + 1,
                                  "999999999999999T", "\uff11\uff12k", "1e5"])
def test_parse_tokens_rejects(text):
    with pytest.raises(InvalidArgumentError):
        parse_tokens(text)


@pytest.mark.parametrize(
    "num, text",
    [(512, "512 B"), (1024, "1 KiB"), (1536, "1.50 KiB"), (65536, "64 KiB"), (786432, "768 KiB"),
     (3 * 2**20, "3 MiB"), (80 * 2**30, "80 GiB"), (2**40, "1 TiB"), (7158235136, "6.67 GiB")],
)
def test_format_bytes(num, text):
    assert format_bytes(num) == text


def test_format_tokens():
    assert format_tokens(1_048_576) == "1,048,576"


def test_limits_are_inclusive_and_named():
    from hybridkv.planner.sizes import MAX_BYTES, MAX_TOKENS

    assert parse_bytes("1024TiB") == MAX_BYTES and parse_tokens("1T") == MAX_TOKENS
    with pytest.raises(InvalidArgumentError, match=r"above the limit of 1024 TiB; check the unit"):
        parse_bytes("999999999999999TiB")
    with pytest.raises(InvalidArgumentError, match=r"above the limit of 1,099,511,627,776"):
        parse_tokens("2T")


def test_decimal_token_counts_match_the_message():
    # the message advertises decimals with k/m/g/t; every such value that is whole parses
    with pytest.raises(InvalidArgumentError, match=r"decimals allowed: 25.6k"):
        parse_tokens("1.5x")
    assert parse_tokens("1.5k") == 1500 and parse_tokens("0.5m") == 500_000


@settings(max_examples=examples(300), deadline=None)
@given(st.text(max_size=12))
def test_parsers_either_parse_in_range_or_raise_one_line(text):
    from hybridkv.planner.sizes import MAX_BYTES, MAX_TOKENS

    for parse, limit in ((parse_bytes, MAX_BYTES), (parse_tokens, MAX_TOKENS)):
        try:
            value = parse(text)
        except InvalidArgumentError as exc:
            assert "\n" not in str(exc)
        else:
            assert isinstance(value, int) and 0 < value <= limit


@settings(max_examples=examples(200), deadline=None)
@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["k", "K", "m", "M", ""]))
def test_whole_token_counts_round_trip(n, suffix):
    base = {"k": 1000, "K": 1024, "m": 10**6, "M": 2**20, "": 1}[suffix]
    if n * base <= 2**40:
        assert parse_tokens(f"{n}{suffix}") == n * base
