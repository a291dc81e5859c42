"""The batch backlog that health reports (SPEC 7, `inference.batch_backlog_rows`): rows not yet run
across active batches, read from PostgreSQL when asked, so every web process answers the same and
a row is counted once however many replicas serve its model. inference_app never imports
batches_app: batches_app registers its reader here from its config."""

_readers = []


def register(reader):
    """`reader()`: {(model, status): rows}. Once per reader: app loading may run again in tests."""
    if reader not in _readers:
        _readers.append(reader)


def by_model():
    """{model: rows} ("" for validating batches whose model is not known yet), or None (never a
    fake 0) when no app counts them."""
    if not _readers:
        return None
    rows = {}
    for reader in _readers:
        for (model, _status), count in reader().items():
            rows[model] = rows.get(model, 0) + count
    return rows


def total_rows():
    """The rows, or None when no app counts them."""
    rows = by_model()
    return None if rows is None else sum(rows.values())
