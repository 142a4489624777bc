"""lit_gpt/manifest.py's checksums: CRC32C (google-crc32c) for new manifests, CRC32 (zlib) manifests of earlier
versions still verified, and a damaged file named with the algorithm that found it."""

import json
import zlib

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
