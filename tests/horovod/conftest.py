def pytest_configure(config):
    config.addinivalue_line("markers", "accuracy: trains to an accuracy; run by make test-accuracy, left out of make test")
