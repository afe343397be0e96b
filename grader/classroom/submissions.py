"""Finding a class's submissions: one folder per student (any notebooks inside, at any depth) or
one file per student named after them. Nothing here writes, and no link is followed: a student's
link could point at the course's solutions or anywhere else on the instructor's machine."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Student:
    name: str
    notebooks: list[Path] = field(default_factory=list)  # absolute paths of their .ipynb files
    notes: list[str] = field(default_factory=list)  # why something of theirs was not graded


def _skipped_folder(name: str) -> bool:
    """Hidden folders (.ipynb_checkpoints holds Jupyter's autosaves, not the submission) and caches."""
    return name.startswith(".") or name == "__pycache__"


def _notebooks_in(folder: Path, root: Path, student: Student) -> None:
    others = []
    for current, folders, files in os.walk(folder, followlinks=False):
        folders[:] = sorted(f for f in folders if not _skipped_folder(f))
        for name in sorted(files):
            path = Path(current) / name
            if name.startswith("."):
                continue
            if path.is_symlink():
                student.notes.append(f"{relative(path, root)}: a symbolic link, not followed")
            elif name.endswith(".ipynb"):
                student.notebooks.append(path)
            else:
                others.append(relative(path, root))
    if not student.notebooks:
        found = f" (it holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''})" if others else ""
        student.notes.append(f"{relative(folder, root)}/: no notebook (.ipynb) in the folder{found}")


def find_students(root: Path) -> list[Student]:
    """The students of SUBMISSIONS, by name; `alice.ipynb` and `alice/` are both Alice's."""
    students: dict[str, Student] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):  # .DS_Store, .git, .ipynb_checkpoints
            continue
        name = printable(entry.name if entry.is_dir() and not entry.is_symlink() else entry.stem)
        student = students.setdefault(name, Student(name))
        if entry.is_symlink():
            student.notes.append(f"{printable(entry.name)}: a symbolic link, not followed")
        elif entry.is_dir():
            _notebooks_in(entry, root, student)
        elif entry.suffix == ".ipynb":
            student.notebooks.append(entry)
        else:
            student.notes.append(f"{printable(entry.name)}: not a notebook (.ipynb), not graded")
    return sorted(students.values(), key=lambda s: s.name)


def printable(name: str) -> str:
    """A file name that is not UTF-8 (Python keeps its bytes as lone surrogates) as it would be
    shown, with U+FFFD for the bytes: the gradebook and the reports are UTF-8 text."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def relative(path: Path, root: Path) -> str:
    return printable(path.relative_to(root).as_posix())


def content_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
