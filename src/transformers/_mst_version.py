"""Local version label of this transformers-mst build.

The installed version is upstream's release plus this label, e.g. ``5.24.0+mst.14``
(patch ``0001-version-string`` appends it to ``transformers.__version__``). Bump it, with a
CHANGELOG.md entry, on every change of what the distribution ships.
"""

LOCAL_VERSION = "mst.45"
