"""The Batch API: a thin DRF viewset; behaviour lives on Batch and in creation/runner."""

from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from batches_app import events
from batches_app.creation import create_batch
from batches_app.models import Batch
from batches_app.shapes import BatchCreate, BatchList, BatchObject
from millm_lib.errors import ApiError
from inference_app.gateway import wake_engines
from inference_app.leases import LEASE_HEADER
from millm_lib.openapi import IDEMPOTENCY_HEADER, PATH_ID, drf_errors
from millm_lib.pagination import list_page, query_int

LEASE_PARAMETER = OpenApiParameter(
    LEASE_HEADER, str, OpenApiParameter.HEADER, description="A lease id: act despite your own lease"
)


@extend_schema_view(
    list=extend_schema(
        summary="List batches, newest first",
        parameters=[
            OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1-100 (default 20)"),
            OpenApiParameter("after", str, OpenApiParameter.QUERY, description="The last id of the previous page"),
        ],
        responses={200: BatchList, **drf_errors()},
    ),
    retrieve=extend_schema(summary="A batch", parameters=[PATH_ID], responses={200: BatchObject, **drf_errors()}),
    create=extend_schema(
        summary="Start a batch from an uploaded file",
        parameters=[LEASE_PARAMETER, IDEMPOTENCY_HEADER],
        request=BatchCreate,
        responses={200: BatchObject, **drf_errors()},
    ),
    cancel=extend_schema(summary="Cancel a batch", parameters=[PATH_ID], request=None,
                         responses={200: BatchObject, **drf_errors()}),
    lease=extend_schema(summary="Hand your live lease (X-miLLM-Lease) to an unfinished batch",
                        parameters=[PATH_ID, LEASE_PARAMETER], request=None,
                        responses={200: BatchObject, **drf_errors()}),
)
class BatchViewSet(viewsets.ViewSet):
    def list(self, request):
        limit = query_int(request, "limit", 20, 1, 100)
        items, has_more = Batch.objects.owned_by(request.project).page(request.query_params.get("after"), limit)
        return Response(list_page(BatchList, [batch.to_openai() for batch in items], has_more))

    def retrieve(self, request, pk=None):
        return Response(_batch(pk, request.project).to_openai())

    def create(self, request):
        batch = create_batch(request.data, request.headers.get(LEASE_HEADER), request.headers.get("Idempotency-Key"),
                             request.project)
        events.publish_and_wake(batch)
        return Response(batch.to_openai())

    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        batch = _batch(pk, request.project).request_cancel()
        events.publish_and_wake(batch)
        return Response(batch.to_openai())

    @action(detail=True, methods=["post"])
    def lease(self, request, pk=None):
        batch = _batch(pk, request.project).hand_lease(request.headers.get(LEASE_HEADER), request.project)
        wake_engines()
        return Response(batch.to_openai())

    def perform_content_negotiation(self, request, force=False):
        return super().perform_content_negotiation(request, force=True)


def _batch(batch_id, project):
    # Another project's batch answers exactly as an unknown id: nothing tells it exists.
    batch = Batch.objects.owned_by(project).filter(pk=batch_id).first()
    if batch is None:
        raise ApiError(404, "batch_not_found", f"No batch has the id '{batch_id}'", param="batch_id")
    return batch
