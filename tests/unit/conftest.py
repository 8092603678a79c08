"""The unit tests' session: mypy (test_code_rules.py) starts in the background once collected,
and its test, which waits for it, runs last, so that the other tests run meanwhile."""


def pytest_collection_modifyitems(items):
    mypy = [item for item in items if item.name == "test_mypy_is_clean"]
    for item in mypy:
        items.remove(item)
    items.extend(mypy)


def pytest_collection_finish(session):
    for item in session.items:
        if item.name == "test_mypy_is_clean":
            item.module.start_mypy()
            return
