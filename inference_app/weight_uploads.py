"""A weights PUT body on its way from web to the engine (SPEC 5, "Weights").

Web streams the body into the files' storage (so the split topology works: both sides reach it)
under `weights-uploads/`, the engine reads it, and web deletes it once the engine has answered.
The file retention sweep removes any a crash left behind.
"""

from django.core.files.base import File
from django.core.files.storage import storages

from millm_lib.ids import new_id

PREFIX = "weights-uploads"


def storage():
    return storages["default"]


def save(stream):
    """Store the body (a file-like object, read in chunks) and return its storage name."""
    return storage().save(f"{PREFIX}/{new_id('wup_')}.safetensors", File(stream))


def read(name):
    with storage().open(name, "rb") as handle:
        return handle.read()


def discard(name):
    storage().delete(name)
