from intervals import merge, overlaps, contains, intersection, total_length


def test_overlaps_touching_point():
    assert overlaps((1, 3), (3, 5))


def test_overlaps_disjoint():
    assert not overlaps((1, 2), (4, 5))


def test_contains_ends():
    assert contains((2, 4), 2) and contains((2, 4), 4)
    assert not contains((2, 4), 5)


def test_intersection():
    assert intersection((1, 5), (3, 8)) == (3, 5)
    assert intersection((1, 2), (5, 6)) is None


def test_merge_overlapping():
    assert merge([(6, 7), (1, 3), (2, 4)]) == [(1, 4), (6, 7)]


def test_merge_adjacent_integers():
    assert merge([(1, 2), (3, 4)]) == [(1, 4)]


def test_merge_keeps_gap():
    assert merge([(1, 2), (4, 5)]) == [(1, 2), (4, 5)]


def test_total_length():
    assert total_length([(1, 3), (2, 5), (10, 10)]) == 6
