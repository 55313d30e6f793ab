"""Read-only API: the caller's projects, with the caller's role in each."""

from __future__ import annotations

from django.db.models import OuterRef, QuerySet, Subquery
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins, serializers, viewsets

from portal.accounts.models import Membership, Project
from portal.accounts.permissions import api_projects
from portal.api.errors import ERRORS
from portal.api.pagination import BySlug
from portal.api.views import ApiView


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
