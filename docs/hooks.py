"""MkDocs hooks of kdp's documentation site (``hooks:`` in mkdocs.yml).

The stored notebooks stay where they are (``notebooks/*.ipynb`` at the
repository root, executed and checked by the tests): they are added to the site
as ``notebooks/<name>.ipynb``, read in place, before mkdocs-jupyter turns them
into pages.
"""

from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the .ipynb files
def on_files(files, config):
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        uri = f"notebooks/{path.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File(uri, src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
