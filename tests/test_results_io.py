"""Result files name the input they were measured on by content, not only by its local file name."""
import hashlib

from kernels.results_io import input_file_record


def test_an_input_file_is_recorded_by_name_size_and_content_hash(tmp_path):
    data = bytes(range(256)) * (10 * 1024 + 3)          # over two read chunks of 1 MiB, and a partial third
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    record = input_file_record(path)
    assert record == {"name": "x.safetensors", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    renamed = tmp_path / "smollm2_layer15.safetensors"
    path.rename(renamed)
    assert input_file_record(renamed)["sha256"] == record["sha256"]
    renamed.write_bytes(data[:-1] + b"\x00")              # one byte changed: another input
    assert input_file_record(renamed)["sha256"] != record["sha256"]
