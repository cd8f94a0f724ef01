"""The engine bench's Nsight Compute parsing (CPU: a CSV in the layout ncu 2025 writes)."""

from megamoe.bench.engine import NCU_METRICS, ncu_bytes_by_case

RANGE = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
NONE6 = ":none" * 6


def _csv(rows: list[tuple[str, list[str]]]) -> list[str]:
    head = ['"ID"', f'"{RANGE}"', '"Kernel Name"', *(f'"{m}"' for m in NCU_METRICS)]
    units = ['""', '""', '""', *('"byte"' for _ in NCU_METRICS)]
    lines = [",".join(head), ",".join(units)]
    for i, (rng, values) in enumerate(rows):
        lines.append(",".join([f'"{i}"', f'"{rng}"', '"k"', *(f'"{v}"' for v in values)]))
    return lines


def test_bytes_are_summed_per_case_range():
    lines = _csv(
        [
            ("", ["9", "9", "9"]),  # a set-up kernel outside every range
            (f"<default domain>:gemm2|engine +a2{NONE6}", ["1,000", "200", "5000"]),
            (f"<default domain>:da2|torch._grouped_mm{NONE6}", ["10", "1", "30"]),
            (f"<default domain>:da2|torch._grouped_mm{NONE6}", ["5", "2", "20"]),
        ]
    )
    totals = ncu_bytes_by_case(lines)
    assert set(totals) == {("gemm2", "engine +a2"), ("da2", "torch._grouped_mm")}
    assert list(totals[("gemm2", "engine +a2")].values()) == [1000.0, 200.0, 5000.0]
    assert list(totals[("da2", "torch._grouped_mm")].values()) == [15.0, 3.0, 50.0]


def test_no_rows_give_no_counts():
    assert ncu_bytes_by_case([]) == {}
    assert ncu_bytes_by_case(_csv([("", ["1", "1", "1"])])) == {}
