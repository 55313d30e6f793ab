from django.contrib import admin

from portal.accounts.models import ApiToken, Membership, Project
from portal.accounts.throttle import ThrottledAdminAuthenticationForm

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
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("name", "user", "key_prefix", "scopes", "created_at", "last_used_at", "revoked_at")
    readonly_fields = ("key_hash", "key_prefix", "created_at", "last_used_at")
