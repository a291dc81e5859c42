"""The Files API: a thin DRF viewset; behaviour lives on File."""

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.parsers import MultiPartParser
from rest_framework.response import Response

from files_app.models import File, IdempotencyKey, disk_full, over_file_quota
from files_app.shapes import FileDeleted, FileList, FileObject, FileUpload
from files_app.uploads import BatchFileUploadHandler, least_file_bytes
from millm_lib.errors import ApiError
from millm_lib.openapi import IDEMPOTENCY_HEADER, PATH_ID, drf_errors
from millm_lib.limits import EXPIRES_AFTER_MAX_S, EXPIRES_AFTER_MIN_S
from millm_lib.pagination import list_page, query_choice, query_int
from millm_lib.streaming import file_response


@extend_schema_view(
    list=extend_schema(
        summary="List files, newest first",
        parameters=[
            OpenApiParameter("purpose", str, OpenApiParameter.QUERY, enum=["batch", "batch_output"]),
            OpenApiParameter("limit", int, OpenApiParameter.QUERY, description="1-10,000 (default 10,000)"),
            OpenApiParameter("after", str, OpenApiParameter.QUERY, description="The last id of the previous page"),
            OpenApiParameter("order", str, OpenApiParameter.QUERY, enum=["asc", "desc"]),
        ],
        responses={200: FileList, **drf_errors()},
    ),
    retrieve=extend_schema(summary="A file", parameters=[PATH_ID], responses={200: FileObject, **drf_errors()}),
    create=extend_schema(
        summary="Upload a batch input file (JSONL)",
        parameters=[IDEMPOTENCY_HEADER],
        request={"multipart/form-data": FileUpload},
        responses={200: FileObject, **drf_errors()},
    ),
    destroy=extend_schema(summary="Delete a file", parameters=[PATH_ID], responses={200: FileDeleted, **drf_errors()}),
    content=extend_schema(
        summary="A file's bytes (application/jsonl whatever Accept says)",
        parameters=[PATH_ID],
        responses={(200, "application/jsonl"): OpenApiResponse({"type": "string", "format": "binary"}),
                   **drf_errors()},
    ),
)
class FileViewSet(viewsets.ViewSet):
    parser_classes = [MultiPartParser]

    def list(self, request):
        files = File.objects.visible().owned_by(request.project)
        purpose = request.query_params.get("purpose")
        if purpose:
            files = files.filter(purpose=purpose)
        limit = query_int(request, "limit", 10_000, 1, 10_000)
        order = query_choice(request, "order", "desc", ("asc", "desc"))
        items, has_more = files.page(request.query_params.get("after"), limit, order)
        return Response(list_page(FileList, [file.to_openai() for file in items], has_more))

    def retrieve(self, request, pk=None):
        return Response(_visible(pk, request.project).to_openai())

    def create(self, request):
        key = request.headers.get("Idempotency-Key")
        existing = IdempotencyKey.lookup("file", key, request.project)
        if existing is not None:
            return Response(File.objects.get(pk=existing).to_openai())
        least = least_file_bytes(request.META.get("CONTENT_LENGTH"))
        refusal = over_file_quota(request.project, least) if least is not None else None
        if refusal is not None:
            raise refusal  # before a byte of the body is parsed
        request._request.upload_handlers = [BatchFileUploadHandler(request._request)]
        purpose = request.data.get("purpose")
        if purpose != File.Purpose.BATCH:
            _discard(request)
            raise ApiError(
                400, "invalid_batch_request",
                f"purpose must be 'batch', got {purpose!r}" if purpose else "purpose is required: send purpose=batch",
                param="purpose",
            )
        upload = request.FILES.get("file")
        if upload is None:
            raise ApiError(400, "invalid_batch_request", "No file: send the JSONL in a multipart part named 'file'", param="file")
        try:
            seconds = _expires_after(request.data)
        except ApiError:
            _discard(request)
            raise
        try:
            file, _ = File.record(upload, File.Purpose.BATCH, seconds, key, project=request.project)
        except ApiError:  # over the project's file_bytes quota
            _discard(request)
            raise
        except OSError as error:
            _discard(request)
            refusal = disk_full(error)
            if refusal is None:
                raise
            raise refusal from error
        return Response(file.to_openai())

    def destroy(self, request, pk=None):
        file = _visible(pk, request.project)
        file.remove()
        return Response(FileDeleted(id=file.id, object="file", deleted=True))

    @action(detail=True, methods=["get"])
    def content(self, request, pk=None):
        # application/jsonl whatever Accept says (the SDK sends application/binary).
        return file_response(_visible(pk, request.project).open_content(), content_type="application/jsonl")

    def perform_content_negotiation(self, request, force=False):
        # JSON whatever Accept says: the SDK asks for application/binary on content downloads.
        return super().perform_content_negotiation(request, force=True)


def _visible(file_id, project):
    # Another project's file answers exactly as an unknown id: nothing tells it exists.
    file = File.objects.visible().owned_by(project).filter(pk=file_id).first()
    if file is None:
        raise ApiError(404, "file_not_found", f"No file has the id '{file_id}'", param="file_id")
    return file


def _discard(request):
    upload = request.FILES.get("file")
    if upload is not None:
        upload.close()


def _expires_after(data):
    """expires_after[anchor]=created_at and expires_after[seconds] (3,600-2,592,000); default
    BATCH_FILE_RETENTION_DAYS."""
    anchor = data.get("expires_after[anchor]")
    seconds = data.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return settings.BATCH_FILE_RETENTION_DAYS * 86_400
    if anchor != "created_at":
        raise ApiError(400, "invalid_batch_request", f"expires_after[anchor] must be 'created_at', got {anchor!r}",
                       param="expires_after[anchor]")
    low, high = EXPIRES_AFTER_MIN_S, EXPIRES_AFTER_MAX_S
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(
            400, "invalid_batch_request",
            f"expires_after[seconds] must be a whole number from {low:,} to {high:,}, got {seconds!r}",
            param="expires_after[seconds]",
        )
    return value
