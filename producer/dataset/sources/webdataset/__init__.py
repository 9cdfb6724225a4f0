"""WebDataset tars, parsed: ``headers`` (the bounded walk over a tar's headers, on a local file or a stream),
``samples`` (members grouped into samples by key, as NumPy arrays), ``index_file`` (that index kept in a file for
the next process to open the tar, parsed and checked when read back), ``fields`` (an extension as a record field, a
member's bytes as its checked value). ``sources/tar_shard.py`` reads a tar shard with them; the index command
(``build/webdataset_index.py``) streams tars through the same walk.
"""
