"""One allow-list: ``.metadata`` pickled by every supported Python reads, for ``ckpt`` and ``--load``.

Python 3.10-3.12 pickle ``PosixPath("/tmp/ck/iter_1")`` as ``pathlib.PosixPath`` called with its
parts; 3.13 as ``pathlib._local.PosixPath`` called with one string. DCP stores such a path in
``StorageMeta.checkpoint_id``, so a checkpoint saved on 3.13 references ``pathlib._local``.
The test crafts both forms on whatever interpreter runs it (:class:`_PathsAs`, checked byte for
byte against what the real interpreters write) and feeds a full ``.metadata`` through the inert
resolver and the reader both ``ckpt`` and ``--load`` open a checkpoint with, checked against
torch's own reader of the same (trusted) fixture. Before the tables were unified, the runtime
refused the 3.13 form.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath, PurePosixPath

import pytest

from gtp_format.errors import FormatError
from gtp_format.reader.allow_list import ALLOWED, Kind
from gtp_format.reader.checkpoint import open_checkpoint
from gtp_format.reader.safe_pickle import MetadataRecord, StorageMetaRecord, inert, load_metadata_pickle

FIXTURE = Path(__file__).parents[2] / "fixtures" / "gtp" / "fold_cp2_g2_dp2" / "iter_0000002"

# pickle.dumps(pathlib.PosixPath("/tmp/ck/iter_1")) as written by the real interpreters (default protocol 4).
WRITTEN_BY = {
    "3.10-3.12": b"\x80\x04\x956\x00\x00\x00\x00\x00\x00\x00\x8c\x07pathlib\x94\x8c\tPosixPath\x94\x93\x94("
                 b"\x8c\x01/\x94\x8c\x03tmp\x94\x8c\x02ck\x94\x8c\x06iter_1\x94t\x94R\x94.",
    "3.13": b"\x80\x04\x955\x00\x00\x00\x00\x00\x00\x00\x8c\x0epathlib._local\x94\x8c\tPosixPath\x94\x93\x94"
            b"\x8c\x0e/tmp/ck/iter_1\x94\x85\x94R\x94.",
}
PATH_FORMS = {"3.10-3.12": ("pathlib", False), "3.13": ("pathlib._local", True)}  # (module, one string)


class _PathsAs(pickle._Pickler):
    """The pure-Python pickler, writing paths the way another Python version does.

    Everything else is pickled as this interpreter pickles it. The path classes are written by
    name (module, class name), so the module needs not exist here (``pathlib._local`` is 3.13's).
    """

    def __init__(self, file: io.BytesIO, module: str, one_string: bool) -> None:
        super().__init__(file, protocol=4)
        self.module, self.one_string = module, one_string
        self.classes = {name: type(name, (), {}) for name in ("PosixPath", "PurePosixPath")}

    def reducer_override(self, obj):
        if type(obj) in (PosixPath, PurePosixPath):
            args = (str(obj),) if self.one_string else tuple(obj.parts)
            return self.classes[type(obj).__name__], args
        return NotImplemented

    def save_global(self, obj, name=None):
        if obj in self.classes.values():
            self.save(self.module)
            self.save(obj.__name__)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
        else:
            super().save_global(obj, name)


def _dumps(obj: object, form: str) -> bytes:
    buf = io.BytesIO()
    _PathsAs(buf, *PATH_FORMS[form]).dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("form", PATH_FORMS)
def test_crafted_path_pickle_is_what_that_python_writes(form: str):
    assert _dumps(PosixPath("/tmp/ck/iter_1"), form) == WRITTEN_BY[form]


def _fixture_metadata() -> object:
    """The fixture's ``.metadata`` as torch's own reader gives it (our own file: trusted; the reference)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(FIXTURE)).read_metadata()


def _metadata(form: str, checkpoint_id: PurePosixPath) -> bytes:
    """The fixture's real ``.metadata``, its checkpoint path pickled as ``form``."""
    md = _fixture_metadata()
    md.storage_meta.checkpoint_id = checkpoint_id  # type: ignore[attr-defined]
    data = _dumps(md, form)
    assert (PATH_FORMS[form][0].encode() + b"\x94\x8c") in data  # the path class really is in there
    return data


@pytest.mark.parametrize("cls", [PosixPath, PurePosixPath])
@pytest.mark.parametrize("form", PATH_FORMS)
def test_every_python_path_form_reads_through_the_one_reader(form: str, cls: type, tmp_path: Path):
    path = cls("/runs/ckpt/iter_0000002")
    data = _metadata(form, path)
    reference = _fixture_metadata()

    record = load_metadata_pickle(data, "inert/.metadata")
    assert isinstance(record, MetadataRecord) and isinstance(record.get("storage_meta"), StorageMetaRecord)
    assert record.get("storage_meta").get("checkpoint_id") == "/runs/ckpt/iter_0000002"
    assert record.get("state_dict_metadata").keys() == reference.state_dict_metadata.keys()  # type: ignore[attr-defined]

    (tmp_path / ".metadata").write_bytes(data)  # the folder as ckpt and --load open it
    for src in FIXTURE.glob("*.distcp"):
        (tmp_path / src.name).write_bytes(src.read_bytes())
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.entries.keys() == reference.state_dict_metadata.keys()  # type: ignore[attr-defined]


def test_the_table_names_what_the_installed_torch_has():
    """Every class and enum entry exists where the table says: a torch that renames a class fails here."""
    import importlib

    for (module, name), entry in ALLOWED.items():
        if entry.kind is Kind.CONTAINER:
            continue  # charged to a per-file budget by the unpickler itself
        assert inert(entry) is not None, (module, name)
        if entry.kind in (Kind.CLASS, Kind.ENUM):
            obj = getattr(importlib.import_module(entry.module), entry.name)
            assert isinstance(obj, type) and obj.__name__ == entry.name, (module, name)
            assert module == entry.module or module.startswith("megatron."), (module, name)


def test_a_global_outside_the_table_is_refused_unrun():
    data = b"\x80\x04\x8c\x02os\x94\x8c\x06system\x94\x93\x94\x8c\x04true\x94\x85\x94R\x94."
    with pytest.raises(FormatError, match=r"references the global os\.system.*nothing in the file was executed"):
        load_metadata_pickle(data, "x/.metadata")
