import pytest

from polykv.server import ServerThread, create_app

from ..engine._models import make_pool, tiny_model

DOC_TEXT = ("The lighthouse keeper of Varnholm logged every ship that passed the northern cape. "
            "In the winter of 1911 the logbook records eleven ships, three of them whalers. ") * 3


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def server(tiny):
    model, tok = tiny
    pool = make_pool(model, tok)
    app = create_app(pool, model_name="tiny-test")
    with ServerThread(app) as srv:
        yield srv
