from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from portal.accounts.models import ApiToken, Membership, Project
from portal.accounts.throttle import ThrottledAdminAuthenticationForm
from portal.accounts.tokens import do_revoke_token
from portal.admin_base import ReadOnlyModelAdmin

# The admin's own sign-in page is a second door for password guessing: same throttle.
admin.site.login_form = ThrottledAdminAuthenticationForm


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "created_at")
    inlines = [MembershipInline]


@admin.register(ApiToken)
class ApiTokenAdmin(ReadOnlyModelAdmin):
    """Tokens are made on the API tokens page (the key is shown there, once); an admin form
    would save a row without a key. Here staff look them up and revoke them (audited)."""

    list_display = (
        "name",
        "user",
        "key_prefix",
        "scopes",
        "created_at",
        "last_used_at",
        "expires_at",
        "state",
    )
    list_filter = ("revoked_at",)
    search_fields = ("name", "user__username", "key_prefix")
    actions = ["revoke"]

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        revoked = [do_revoke_token(request.user, pk) for pk in queryset.values_list("pk", flat=True)]
        self.message_user(request, f"{len([t for t in revoked if t])} tokens revoked.", messages.SUCCESS)
