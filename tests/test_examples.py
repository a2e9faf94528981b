"""The README's main job: every seven-case example, eager and exported, against its reference."""

import seven_cases


def test_seven_cases_main_reports_every_case(capsys):
    assert seven_cases.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for case in seven_cases.CASES:
        assert case.name in out
    assert "all cases ok" in out
