"""Start the engine: the resident model, the admission slot, the interactive consumer, the
batch runner, the webhook courier, and the housekeeping beside them (retention of files and ended batches)."""

import logging
import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand

from batches_app.retention import run_retention
from inference_app.catalogue import model_source


class Command(BaseCommand):
    help = "Run the engine: load the model (MILLM_MODEL) and serve requests forwarded by web processes."

    def add_arguments(self, parser):
        parser.add_argument("--model", help="A model folder or .gguf file (default: MILLM_MODEL, else SmolLM2)")
        parser.add_argument("--model-id", help="The catalogue id to serve it under (default: MILLM_MODEL_ID, else derived)")

    def handle(self, *args, model=None, model_id=None, **options):
        from inference_app.engine.worker import Worker

        logging.getLogger("millm").setLevel(logging.INFO)
        from batches_app.runner import BatchRunner
        from webhooks_app.courier import WebhookCourier

        jobs = [("retention", settings.BATCH_RETENTION_INTERVAL_S, run_retention)]
        status = Worker(model_source(model, model_id, settings.MILLM_CHAT_TEMPLATE), jobs=jobs, companions=[BatchRunner, WebhookCourier]).run()
        # The engine has stopped and said so (its row is gone, its seats ended, what it recorded
        # committed). The interpreter's own teardown of torch and the model would take a second
        # more of every stop and restart; nothing is left for it to do.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
