import pytest

from taskplatform import submit
from taskplatform.models import Execution

pytestmark = [pytest.mark.worker]


def test_submitted_execution_completes(workers, poll):
    workers.start()
    execution = submit("testapp.effect", kwargs={"seconds": 0})
    poll(lambda: Execution.objects.get(pk=execution.pk).state == "SUCCEEDED", timeout=30, what="success")
