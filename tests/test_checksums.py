"""lit_gpt/manifest.py's checksums: CRC32C (google-crc32c) for new manifests, CRC32 (zlib) manifests of earlier
versions still verified, and a damaged file named with the algorithm that found it."""

import json
import re
import zlib
from pathlib import Path

import google_crc32c

from lit_gpt.manifest import MANIFEST, file_checksum, read_manifest, step_problem, write_manifest


def make_step(folder, payload=b"weights" * 1000):
    folder.mkdir()
    (folder / "checkpoint.pth").write_bytes(payload)
    (folder / "lit_config.json").write_text("{}")
    (folder / "sub").mkdir()
    (folder / "sub" / "shard.bin").write_bytes(bytes(range(256)) * 5)
    return folder


def test_new_manifests_record_crc32c_and_verify(tmp_path):
    step = make_step(tmp_path / "step-000001")
    write_manifest(step)
    manifest, _ = read_manifest(step)
    entry = manifest["checksums"]["checkpoint.pth"]
    assert entry == {"size": 7000, "crc32c": f"{google_crc32c.value(b'weights' * 1000):08x}"}
    assert set(manifest["checksums"]) == {"checkpoint.pth", "lit_config.json", "sub/shard.bin"}
    assert step_problem(step, "checkpoint.pth") is None


def test_a_flipped_byte_is_found_by_crc32c(tmp_path):
    step = make_step(tmp_path / "step-000001")
    write_manifest(step)
    data = bytearray((step / "sub" / "shard.bin").read_bytes())
    data[100] ^= 1
    (step / "sub" / "shard.bin").write_bytes(bytes(data))
    problem = step_problem(step, "checkpoint.pth")
    assert problem.kind == "damaged" and problem.name == "sub/shard.bin"
    assert problem.difference.startswith("CRC32C ") and "instead of" in problem.difference


def test_an_old_crc32_manifest_still_verifies_and_finds_damage(tmp_path):
    step = make_step(tmp_path / "step-000001")
    old = {name: {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
           for name, data in ((n, (step / n).read_bytes()) for n in ("checkpoint.pth", "lit_config.json"))}
    (step / MANIFEST).write_text(json.dumps({"format": "lit-gpt-step", "version": 1, "checksums": old}))
    assert step_problem(step, "checkpoint.pth") is None
    assert file_checksum(step / "checkpoint.pth", "crc32") == old["checkpoint.pth"]
    (step / "checkpoint.pth").write_bytes(b"Weights" * 1000)  # same size, other bytes
    problem = step_problem(step, "checkpoint.pth")
    assert problem.kind == "damaged" and problem.difference.startswith("CRC32 "), problem


def test_the_docs_state_the_speed_and_a_7b_and_70b_cost_that_follow_from_it():
    """xla/README.md, "Verifying checkpoints at scale": the measured GB/s are stated, and every time in the 7B/70B
    table is its step size (12 bytes per parameter) over the stated speed and host count, to the table's rounding.
    The CRC32C in use is google-crc32c's C extension (the CPU's instruction), not its pure-Python fallback."""
    assert google_crc32c.implementation == "c"
    readme = (Path(__file__).resolve().parents[1] / "xla" / "README.md").read_text()
    section = readme.split("### Verifying checkpoints at scale", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"CRC32C [\d.]+-[\d.]+\s+GB/s, zlib's CRC32 [\d.]+-[\d.]+ GB/s", section)
    header = next(line for line in section.splitlines() if line.startswith("| Model |"))
    assert re.findall(r"\(([\d.]+) GB/s\)", header) == ["0.7", "6"] and "8 hosts" in header and "64 hosts" in header
    speeds_hosts = [(0.7, 1), (6.0, 1), (6.0, 8), (6.0, 64)]
    table = [line for line in section.splitlines() if re.match(r"\| \d+B \|", line)]
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in table)}
    assert set(rows) == {"7B", "70B"}
    for model, (size, *times) in rows.items():
        gigabytes = float(size.strip("~ GB"))
        assert gigabytes == int(model[:-1]) * 12
        for text, (speed, hosts) in zip(times, speeds_hosts):
            if text == "-":
                continue
            value, unit = re.fullmatch(r"~([\d.]+) (s|min)", text).groups()
            stated = float(value) * (60 if unit == "min" else 1)
            expected = gigabytes / speed / hosts
            assert abs(stated - expected) <= max(0.3 * expected, 0.5), (model, text, expected)
