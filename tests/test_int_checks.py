import pytest

from kernels.int_checks import check_count


def test_check_count_returns_an_int_within_its_bounds():
    assert check_count(0, "follow_step", 0) == 0
    assert check_count(7, "num_splits", 1, 8) == 7


@pytest.mark.parametrize("value, minimum, maximum, unit, message", [
    (0, 1, None, None, "page_size must be a positive int, got 0"),
    (True, 1, None, None, "page_size must be a positive int, got True"),
    (2.0, 1, None, None, "page_size must be a positive int, got 2.0"),
    (-1, 0, None, "blocks", r"page_size must be an int >= 0 \(blocks\), got -1"),
    (9, 1, 8, None, r"page_size must be an int in \[1, 8\], got 9"),
    ("3", 1, 8, None, r"page_size must be an int in \[1, 8\], got '3'"),
])
def test_check_count_names_the_argument_and_what_it_must_be(value, minimum, maximum, unit, message):
    with pytest.raises(ValueError, match=message):
        check_count(value, "page_size", minimum, maximum, unit=unit)
