import pytest

from pipellm.pipeline.partition import even_partition, make_partition


@pytest.mark.parametrize("layers,stages,expected", [
    (30, 2, [15, 15]), (30, 4, [8, 8, 7, 7]), (5, 3, [2, 2, 1]), (7, 7, [1] * 7), (10, 1, [10]), (31, 2, [16, 15]),
])
def test_even_partition_gives_leftovers_to_early_stages(layers, stages, expected):
    assert even_partition(layers, stages) == expected


def test_stage_layout_and_description():
    stages = make_partition(30, 2)
    assert [(s.start, s.end, s.is_first, s.is_last) for s in stages] == [(0, 15, True, False), (15, 30, False, True)]
    assert [s.describe() for s in stages] == ["stage 0: embed + layers 0-14", "stage 1: layers 15-29 + norm + lm_head"]
    assert make_partition(4, 1)[0].describe() == "stage 0: embed + layers 0-3 + norm + lm_head"
    assert [(s.start, s.end) for s in make_partition(30, 3, [10, 12, 8])] == [(0, 10), (10, 22), (22, 30)]


@pytest.mark.parametrize("stages,partition,message", [
    (5, None, "greater than the model's 4 layers"),
    (2, [1, 2], "sums to 3"),
    (2, [4, 0], "at least one layer"),
    (2, [2, 1, 1], "has 3 entries"),
])
def test_bad_partitions(stages, partition, message):
    with pytest.raises(ValueError, match=message):
        make_partition(4, stages, partition)
