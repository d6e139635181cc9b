"""RunWriteError: what every writer of the run raises for a file it could not write (no disk needed)."""

from __future__ import annotations

import errno
import pickle

import pytest

from nemo_rl.utils.write_errors import RunWriteError, as_write_error, errno_of, naming_write


class SafetensorError(Exception):
    """Stands in for safetensors' own error type: not an OSError, the errno only in its text."""


def test_an_os_error_is_named_by_the_file_being_written():
    with pytest.raises(RunWriteError) as caught:
        with naming_write("/ck/.tmp-step_3/optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", "/ck/.tmp-step_3/.optimizer.pt.123.tmp")
    err = caught.value
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC
    assert str(err) == "cannot write /ck/.tmp-step_3/optimizer.pt: [Errno 28] No space left on device"


def test_a_library_error_with_an_os_error_in_its_text_becomes_one():
    exc = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert errno_of(exc) == errno.ENOSPC
    err = as_write_error(exc, "/ck/model.safetensors")
    assert str(err) == "cannot write /ck/model.safetensors: [Errno 28] No space left on device"


def test_other_errors_keep_their_type_and_a_named_one_is_not_renamed():
    with pytest.raises(TypeError):
        with naming_write("/x"):
            raise TypeError("a bug, not the disk")
    inner = RunWriteError(errno.EIO, "Input/output error", "/ck/inner.json")
    with pytest.raises(RunWriteError) as caught:
        with naming_write("/ck"):
            raise inner
    assert caught.value is inner
    assert as_write_error(OSError(errno.EROFS, "Read-only file system", "/ro/f"), None).filename == "/ro/f"


def test_it_pickles_like_an_os_error():
    err = pickle.loads(pickle.dumps(RunWriteError(errno.ENOSPC, "No space left on device", "/ck/f")))
    assert type(err) is RunWriteError and (err.errno, err.filename) == (errno.ENOSPC, "/ck/f")
    assert str(err) == "cannot write /ck/f: [Errno 28] No space left on device"
