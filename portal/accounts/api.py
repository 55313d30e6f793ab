"""The accounts' API: the caller's projects, with the caller's role in each (read-only), and
the caller's own SSH keys (list, add, remove)."""

from __future__ import annotations

from typing import Any

from django.db.models import OuterRef, QuerySet, Subquery
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from portal.accounts import ssh_keys
from portal.accounts.models import ApiToken, Membership, Project, SshKey
from portal.accounts.permissions import api_projects
from portal.api import idempotency
from portal.api.errors import ERRORS, errors
from portal.api.pagination import BySlug, CheckedPageSize
from portal.api.strict import StrictSerializer, Text
from portal.api.views import ApiView
from wire.ssh import MAX_BLOB_CHARS


class ProjectSerializer(serializers.ModelSerializer[Project]):
    role = serializers.CharField(
        allow_null=True, help_text="Your role: manager, member or billing; null for an admin outside it."
    )

    class Meta:
        model = Project
        fields = ["slug", "name", "role", "created_at"]
        read_only_fields = fields


@extend_schema_view(
    list=extend_schema(
        summary="Projects",
        description="The projects you can see, with your role. Scope read:usage.",
        responses={200: ProjectSerializer(many=True), **ERRORS},
    )
)
class ProjectViewSet(ApiView, mixins.ListModelMixin, viewsets.GenericViewSet[Project]):
    serializer_class = ProjectSerializer
    pagination_class = BySlug
    queryset = Project.objects.none()  # for the schema; get_queryset scopes it

    def get_queryset(self) -> QuerySet[Project]:
        mine = Membership.objects.filter(project=OuterRef("pk"), user_id=int(self.request.user.pk or 0))
        role = mine.values("role")[:1]
        return api_projects(self.request).distinct().annotate(role=Subquery(role))


class SshKeySerializer(serializers.ModelSerializer[SshKey]):
    key_type = serializers.CharField(read_only=True, help_text="e.g. ssh-ed25519")

    class Meta:
        model = SshKey
        fields = ["id", "name", "key_type", "fingerprint", "public_key", "created_at", "last_offered_at"]
        read_only_fields = fields
        extra_kwargs = {
            "public_key": {"help_text": "The key as sandboxes get it: '<type> <base64>', no comment."},
            "last_offered_at": {
                "help_text": "When an SSH connection of yours last offered it to a sandbox (all your keys "
                "are offered; which one logged in, only the sandbox knows)."
            },
        }


class SshKeyCreateSerializer(StrictSerializer):
    public_key = Text(
        max_length=MAX_BLOB_CHARS + 400, help_text="One line of a .pub file: '<type> <base64> [comment]'."
    )
    name = Text(max_length=100, required=False, default="", help_text="Defaults to the key's comment.")


class SshKeysNewestFirst(CheckedPageSize):
    ordering = ("-created_at", "-id")


@extend_schema_view(
    list=extend_schema(
        summary="Your SSH keys",
        description="The public keys you log in to your sandboxes with over SSH through the portal "
        "(`gpushare ssh-config`), newest first, cursor pages. Scope write:sandboxes.",
        responses={200: SshKeySerializer(many=True), **ERRORS},
    ),
    create=extend_schema(
        summary="Add an SSH key",
        description="Types: ssh-ed25519, ecdsa-sha2-nistp256/384/521, ssh-rsa of 3072 bits or more, and "
        "their FIDO (sk-) forms. Scope write:sandboxes.",
        parameters=[idempotency.PARAMETER],
        request=SshKeyCreateSerializer,
        responses={201: SshKeySerializer, **errors(400, 401, 403, 422, 429)},
    ),
    destroy=extend_schema(
        summary="Remove an SSH key",
        description="Connections already open stay open. Scope write:sandboxes.",
        responses={204: None, **errors(401, 403, 404, 429)},
    ),
)
class SshKeyViewSet(
    ApiView,
    mixins.ListModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet[SshKey],
):
    """Each user's own keys: nobody, staff included, lists or removes another's."""

    serializer_class = SshKeySerializer
    pagination_class = SshKeysNewestFirst
    queryset = SshKey.objects.none()  # for the schema; get_queryset scopes it
    read_scope = write_scope = ApiToken.Scope.WRITE_SANDBOXES

    def get_queryset(self) -> QuerySet[SshKey]:
        return SshKey.objects.filter(user_id=int(self.request.user.pk or 0))

    @idempotency.idempotent
    def create(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        given = SshKeyCreateSerializer(data=request.data)
        given.is_valid(raise_exception=True)
        try:
            data = given.validated_data
            row = ssh_keys.do_add_key(request.user, data["name"], data["public_key"])
        except ssh_keys.SshKeyError as exc:
            raise exceptions.ValidationError({exc.field: [exc.message]}) from exc
        return Response(SshKeySerializer(row).data, status=status.HTTP_201_CREATED)

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        row = self.get_object()  # 404 for another's key
        ssh_keys.do_remove_key(request.user, row.pk)
        return Response(status=status.HTTP_204_NO_CONTENT)
