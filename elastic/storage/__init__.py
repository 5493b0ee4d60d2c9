"""Storage: checkpoint and data URIs (local paths, S3 and other object stores) to fsspec and pyarrow
filesystems, and the up-front access check."""

from elastic.storage.filesystems import (
    StorageLocation,
    check_storage,
    fsspec_filesystem,
    fsspec_options,
    parse_uri,
    pyarrow_filesystem,
    require_filesystem,
    s3_endpoint,
    s3_region,
)

__all__ = [
    "StorageLocation",
    "check_storage",
    "fsspec_filesystem",
    "fsspec_options",
    "parse_uri",
    "pyarrow_filesystem",
    "require_filesystem",
    "s3_endpoint",
    "s3_region",
]
