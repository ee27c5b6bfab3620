"""units: every size form users type, and the ones that must be refused (exit 2, never a crash)."""
import pytest

from ckplan.errors import UsageError
from ckplan.units import MAX_SIZE, format_bytes, parse_size


@pytest.mark.parametrize("text,expected", [
    ("12GB", 12 * 10**9), ("12GiB", 12 * 2**30), ("1.5GiB", 3 * 2**29), ("500MB", 500 * 10**6),
    ("4096", 4096), ("4096B", 4096), ("2k", 2000), ("2KiB", 2048), (" 3 mb ", 3 * 10**6),
    ("1e3MB", 10**9), ("1E3", 1000), (".5KiB", 512), ("1.GB", 10**9), (7, 7), ("8TiB", 8 * 2**40),
])
def test_parse_size_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1e400", "1e400GB", "1e19", "9999999PB", 10**30])
def test_parse_size_too_large_is_a_usage_error_not_overflow(text):
    with pytest.raises(UsageError, match="larger than any machine"):
        parse_size(text, what="budget")


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-5", "-5GB", "12 parsecs", "GB", "", "1e", "0x10", True])
def test_parse_size_rejects_non_sizes(text):
    with pytest.raises(UsageError, match="not a size"):
        parse_size(text, what="budget")


@pytest.mark.parametrize("text", ["0", "0GB"])
def test_parse_size_rejects_zero(text):
    with pytest.raises(UsageError, match="more than 0 bytes"):
        parse_size(text)


@pytest.mark.parametrize("text", ["0.4", "1e-400", "0.0001KB"])
def test_parse_size_rejects_under_one_byte(text):
    with pytest.raises(UsageError, match="under one byte"):
        parse_size(text)


def test_parse_size_names_the_option():
    with pytest.raises(UsageError, match=r"memory_limit 'lots'"):
        parse_size("lots", what="memory_limit")


def test_max_size_is_accepted():
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE


@pytest.mark.parametrize("n,text", [(None, "-"), (0, "0 B"), (1536, "1.5 KiB"), (3 * 2**30, "3 GiB"),
                                    (-2048, "-2 KiB"), (150 * 2**20, "150 MiB")])
def test_format_bytes(n, text):
    assert format_bytes(n) == text


def test_dead_helpers_are_gone():
    import ckplan.spec
    import ckplan.units
    assert not hasattr(ckplan.units, "format_pct") and not hasattr(ckplan.spec, "numel")
