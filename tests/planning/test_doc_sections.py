from dynapipe_ext.report.doc_sections import replace_section, section_markers, write_section


def test_replace_section_changes_only_its_own_markers():
    start, end = section_markers("throughput")
    p_start, p_end = section_markers("planner")
    text = (f"# B\n\n## Planner\n{p_start}\nkeep me\n{p_end}\n\n## Training throughput\n"
            f"{start}\nold\n{end}\n\n## Other\nme too\n")
    new = replace_section(text, "throughput", "Training throughput", "new table\n")
    assert f"{start}\nnew table\n{end}" in new
    assert "old" not in new
    assert f"{p_start}\nkeep me\n{p_end}" in new and new.endswith("## Other\nme too\n")


def test_missing_section_is_appended_under_its_title(tmp_path):
    path = tmp_path / "BENCH.md"
    write_section(path, "schedules", "Schedules", "table one")
    write_section(path, "planner", "Planner", "table two")
    write_section(path, "schedules", "Schedules", "table three")
    text = path.read_text()
    start, end = section_markers("schedules")
    assert text.startswith("# Benchmarks\n\n## Schedules\n")
    assert f"{start}\ntable three\n{end}" in text and "table one" not in text
    assert "## Planner\n<!-- planner:start -->\ntable two\n<!-- planner:end -->" in text
