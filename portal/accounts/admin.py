from django.contrib import admin

from portal.accounts.models import ApiToken, Membership, Project


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
